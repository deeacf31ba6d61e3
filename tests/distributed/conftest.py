def pytest_configure(config) -> None:
    config.addinivalue_line("markers", "gpu: needs a CUDA GPU (skipped without one); run with `make gpu-check`")
