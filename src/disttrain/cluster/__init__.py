"""Emulated multi-node clusters on one machine: network namespaces, shaped links, CPU quotas.

`disttrain cluster up NAME --nodes N --link RATE` (cli.py) builds one with net.py and
cgroups.py; `disttrain run --cluster NAME` starts a job's nodes inside it
(disttrain/launch/cluster_run.py); launchers.py derives torchrun's environment from
`srun` and `mpiexec`. Import the submodules themselves; this package face only keeps
the deprecated aliases of the modules that moved out.
"""

from disttrain.deprecation import moved_module

# NOTE: deprecated for one release: the cost model is comm's, the cluster job runner launch's.
moved_module("disttrain.cluster.model", "disttrain.comm.cost")
moved_module("disttrain.cluster.run", "disttrain.launch.cluster_run")
