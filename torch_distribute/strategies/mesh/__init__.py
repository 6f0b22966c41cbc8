"""Device meshes with named axes and the layouts that split a model over them.

``DeviceMesh`` (``device_mesh.py``) arranges the workers; ``LayoutMap`` (``layout_map.py``)
says how parameters and outputs are split over its axes; ``plan.py`` turns a map into torch's
``parallelize_module`` plan for one model, refusing what cannot work; ``topology.py`` says
which replica a worker belongs to.
"""

from torch_distribute.strategies.mesh.device_mesh import DeviceMesh
from torch_distribute.strategies.mesh.layout_map import LayoutMap
from torch_distribute.strategies.mesh.plan import TensorParallelPlan, check_all_matched, plan_for
from torch_distribute.strategies.mesh.topology import MeshLayout, MeshPlace

__all__ = ["DeviceMesh", "LayoutMap", "MeshLayout", "MeshPlace", "TensorParallelPlan", "check_all_matched", "plan_for"]
