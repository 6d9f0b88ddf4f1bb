"""Device meshes, logical-axis sharding rules and multi-process start-up."""

from lclm.parallel.mesh import make_mesh

__all__ = ["make_mesh"]
