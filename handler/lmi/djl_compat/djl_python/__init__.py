"""batchyard's stand-in for DJL Serving's `djl_python` handler API, used only when the real
package is not installed (its folder is appended to sys.path, never prepended). It keeps the
documented behaviour of Input, Output, PairList and encode/decode, so that an LMI model.py runs
unchanged."""

from .inputs import Input
from .outputs import Output
from .pair_list import PairList

__all__ = ["Input", "Output", "PairList"]
