"""The registered features: a new feature is one module in features/ and one entry in FEATURES."""

from llmtune.errors import UserError
from llmtune.features.adapters import Adapters
from llmtune.features.base import Features
from llmtune.features.documents import PackedDocuments
from llmtune.features.expert_parallel import ExpertParallel
from llmtune.features.float8 import Float8Training
from llmtune.features.freezing import Freezing
from llmtune.features.fused_kernels import FusedKernels
from llmtune.features.multimodal_freezing import MultimodalFreezing
from llmtune.features.multimodal_positions import MultimodalPositions
from llmtune.features.quantization import QuantizedBase
from llmtune.features.router_loss import RouterLoss
from llmtune.features.tensor_parallel import TensorParallel
from llmtune.features.ulysses import ContextParallel

# TensorParallel first: every other feature acts on the split model, and context parallelism slices rows it has
# padded. QuantizedBase after Adapters: it quantizes what the adapters leave frozen. MultimodalPositions after
# PackedDocuments: it replaces the text positions the documents' transform reads. MultimodalFreezing after Adapters
# and Freezing, whose choice it narrows.
FEATURES = (TensorParallel, ContextParallel, PackedDocuments, MultimodalPositions, FusedKernels, Float8Training, Adapters,
            QuantizedBase, Freezing, MultimodalFreezing, RouterLoss, ExpertParallel)


def check_features(config, model_config, world_size: int) -> None:
    """Every problem the enabled features find with the recipe and the model's transformers config, in one
    message, before any process starts."""
    enabled = [feature for feature in FEATURES if feature.enabled(config)]
    problems = [problem for feature in enabled for problem in feature.check(config, model_config, world_size)]
    if problems:
        raise UserError("\n".join(problems))


def enabled_features(config) -> Features:
    return Features([feature(config) for feature in FEATURES if feature.enabled(config)])
