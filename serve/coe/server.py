"""`baton serve --coe COE.yaml`: a Composition of Experts behind one gRPC endpoint.

The server is BatonServer's (health, reflection, auth, TLS, metrics, drain) with a CoERuntime:
it binds first (health NOT_SERVING), loads the router and every expert, then serves; on SIGTERM
it drains every expert's in-flight requests and stops their engines (server.serve's life cycle:
`run(config, lambda c: CoEServer(c, coe))`).
"""

from __future__ import annotations

from baton.common.config import DTYPES, ConfigError
from baton.serve.coe.config import CoEConfig, load_coe_config
from baton.serve.coe.runtime import CoERuntime
from baton.serve.server import BatonServer, ServerConfig


class CoEServer(BatonServer):
    def __init__(self, config: ServerConfig, coe: CoEConfig):
        dtype = DTYPES[config.dtype] if config.dtype else None
        rt = CoERuntime(coe, config.limits, config.engine, config.device, dtype, config.drain_timeout_s)
        super().__init__(config, runtime=rt)

    async def load(self) -> None:
        await self.rt.load_all()
        self._log_ready()

    async def drain_and_stop(self) -> None:
        await super().drain_and_stop()
        await self.rt.shutdown_all()


def coe_server_config(path: str, config: ServerConfig) -> tuple[ServerConfig, CoEConfig]:
    """The checked CoE file (ConfigError before any port is bound) and the server config naming it."""
    if config.http_port is not None:
        raise ConfigError("--http-port is not served with --coe yet: use the gRPC APIs (Baton, KServe v2)")
    if config.engine.num_kv_blocks is not None:
        raise ConfigError("--num-kv-blocks sizes one pool: with --coe give each expert kv_cache_mb in the CoE file")
    coe = load_coe_config(path, config.engine.kv_cache_bytes)
    config.model, config.model_name = path, config.model_name or coe.name
    coe.name = config.model_name
    return config, coe
