"""Emulated multi-node clusters on one machine: network namespaces, shaped links, CPU quotas.

`disttrain cluster up NAME --nodes N --link RATE` (cli.py) builds one with net.py and
cgroups.py; `disttrain run --cluster NAME` starts a job's nodes inside it (run.py);
model.py is the alpha-beta model that `disttrain.comm.algorithms`' `auto` plans with.
Import the submodules themselves; this package face stays empty so that importing
model.py costs nothing.
"""
