"""Model families. Adding one: its family file, one line in MODELS, conf/model/<arch>.yaml, its tests."""

from mixdepth.models.dense import DenseConfig, DenseLM
from mixdepth.models.mod import MoDConfig, MoDLM
from mixdepth.models.moda import MoDAConfig, MoDALM
from mixdepth.models.mode import MoDEConfig, MoDELM

MODELS: dict[str, tuple[type, type]] = {
    "dense": (DenseConfig, DenseLM),
    "mod": (MoDConfig, MoDLM),
    "moda": (MoDAConfig, MoDALM),
    "mode": (MoDEConfig, MoDELM),
}
