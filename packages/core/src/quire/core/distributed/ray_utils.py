"""Ray, Quire's optional cluster manager (``pip install quire-core[ray]``): imported only when a backend
asks for it, with one clear error when it is absent.

Quire joins the cluster ``RAY_ADDRESS`` names (``ray start --head`` on one machine, ``ray start
--address=HEAD:6379`` on the others, then ``RAY_ADDRESS=HEAD:6379 quire serve ...``); without it, it joins a
cluster already running on this machine, or starts a private one-machine cluster (Ray's own ``ray.init()``
rules).
"""

from __future__ import annotations

import logging

from quire.core.errors import ConfigError

logger = logging.getLogger(__name__)


def import_ray():
    """The ``ray`` module; ConfigError saying how to install it when it is absent."""
    try:
        import ray
    except ImportError:
        raise ConfigError("the ray backend needs Ray: pip install 'quire-core[ray]'") from None
    return ray


def ensure_ray_initialized():
    """Connect this process to the Ray cluster (once; see the module's note for which) and return ``ray``."""
    ray = import_ray()
    if not ray.is_initialized():
        ray.init(include_dashboard=False, log_to_driver=True, ignore_reinit_error=True)
        logger.info("joined the Ray cluster: %s CPUs, %d nodes", ray.cluster_resources().get("CPU", 0),
                    len([node for node in ray.nodes() if node.get("Alive")]))
    return ray
