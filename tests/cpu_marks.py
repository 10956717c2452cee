"""Skip marks for tests that need what this torch build or CPU may lack."""

from __future__ import annotations

import pytest

from trtllm_dflash.models.linear import fbgemm_fp16

NO_FBGEMM = "this torch build has no fbgemm (not x86)"
needs_fbgemm = pytest.mark.skipif(not fbgemm_fp16(), reason=NO_FBGEMM)
