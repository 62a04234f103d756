"""The torch backend's parts: batch groups and tiles (plan), tensor gathering (gather), the chunked softmax (attend)."""
