"""The launcher: `disttrain run` and everything between a job's ranks and the terminal.

- cli.py: the `run` subcommand's flags -> a `RunConfig`;
- job.py: `RunConfig` and `run(cfg)`: torch's elastic agent starts and watches the ranks;
- entry.py: what each rank runs (the user's script, or `-m` module, as `__main__`, its
  failure recorded; standard library only, started by path);
- failures.py: which rank caused a failure, and what the launcher prints;
- hang_report.py: one merged report from every rank's flight-recorder state;
- rendezvous.py: several nodes meet through torch's c10d rendezvous;
- cluster_run.py: `run --cluster NAME`, one agent per node of an emulated cluster (cluster/).

Importing this package is cheap; `RunConfig` and `run` load torch's elastic agent on
first use.
"""

__all__ = ["RunConfig", "run"]


def __getattr__(name: str):
    if name in __all__:
        from disttrain.launch import job

        return getattr(job, name)
    raise AttributeError(f"module 'disttrain.launch' has no attribute {name!r}")
