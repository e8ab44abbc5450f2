"""Linear-attention kernels: Triton for GPUs, each beside the PyTorch reference it must match."""

if __name__ == "kernels":  # imported by that name only when the checkout's root is on sys.path
    import importlib.metadata

    try:
        importlib.metadata.version("kernels")
    except importlib.metadata.PackageNotFoundError:
        pass
    else:
        raise ImportError(
            "linearize's kernels/ folder was imported as the `kernels` package that transformers needs, because the "
            "repository root is on sys.path: run Python with -P (or PYTHONSAFEPATH=1), or from another directory"
        )
