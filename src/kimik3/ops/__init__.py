"""Compute ops: each a package with one public function (its fast GPU paths dispatched inside, `backend`) and its
pure-PyTorch reference beside it."""
