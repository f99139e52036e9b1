import pytest


@pytest.fixture(autouse=True)
def torch_kernels(monkeypatch):
    """The search is under test here, not the native kernels: the engine runs on torch's ops, so a test
    never waits for (or on another process's) native build."""
    monkeypatch.setenv("MOETAILOR_NATIVE", "0")
