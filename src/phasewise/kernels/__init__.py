"""phasewise's own C++ CPU kernels, each beside a pure-PyTorch reference (see build.py)."""
