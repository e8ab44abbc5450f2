"""Linear-attention kernels: Triton for GPUs, each beside the PyTorch reference it must match."""

if __name__ == "kernels":
    # Python started in the checkout's root (a script or a REPL there) finds this folder before the hub's
    # `kernels` package that transformers imports. Hand the import over to that package when it is installed;
    # without it, transformers finds no version here and treats `kernels` as absent.
    import importlib.metadata
    import importlib.util
    import sys

    try:
        _init = importlib.metadata.distribution("kernels").locate_file("kernels/__init__.py")
    except importlib.metadata.PackageNotFoundError:
        _init = None
    if _init is not None and _init.is_file():
        _spec = importlib.util.spec_from_file_location("kernels", _init, submodule_search_locations=[str(_init.parent)])
        _real = importlib.util.module_from_spec(_spec)
        sys.modules["kernels"] = _real  # the import statement returns what sys.modules holds after this file runs
        _spec.loader.exec_module(_real)
