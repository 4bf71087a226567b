"""Models: the shared backbone and one thin file per variant, the cache objects, the declared
inference options and the convergence criteria. Imports the config only; the registry that maps
an arch name to its model class and objective is `latentloop.archs`."""

from .backbone import GPT, ModelOutput, norm
from .cache import KVCache
from .criteria import KLDivergence, RelativeChange
from .options import DecodeOption, check_options

__all__ = ["GPT", "DecodeOption", "KLDivergence", "KVCache", "ModelOutput", "RelativeChange", "check_options", "norm"]
