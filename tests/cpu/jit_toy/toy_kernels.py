"""A tiny Numba-cached kernel set for the tier tests (tests/cpu/test_jit.py)."""
import os

from numba import njit


@njit(cache=True)
def twice(x):
    return 2.0 * x


def warm():
    """The set's warm-up; TOY_WARM_LOG gets a line per compiling run, TOY_WARM_EXIT makes it crash."""
    if os.environ.get("TOY_WARM_EXIT"):
        os._exit(int(os.environ["TOY_WARM_EXIT"]))
    if os.environ.get("TOY_WARM_LOG"):
        with open(os.environ["TOY_WARM_LOG"], "a") as f:
            f.write(f"{os.getpid()}\n")
    twice(1.5)
