"""Parameter-server machinery behind ``ParameterServerStrategy``: RPC transport, PS-held
variables, the worker's runtime and the serving loop (``td.distribute_server``)."""

from torch_distribute.ps.server import distribute_server

__all__ = ["distribute_server"]
