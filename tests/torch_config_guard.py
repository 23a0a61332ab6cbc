"""The suite's guard on torch's config modules, an autouse fixture that tests/conftest.py imports (and an
inner pytest session can import too: tests/test_config_guard.py)."""
import pytest


@pytest.fixture(autouse=True)
def torch_configs_left_as_found(request):
    """Every test leaves torch's config modules as it found them: an entry changed, or deleted (pytest's
    monkeypatch undo deletes an attribute that is not in a module's own `__dict__`, and torch then hides
    the entry from every later compile in the worker), fails the test at teardown, naming the entry. Change
    a torch config with its own `config.patch(...)`. The entries are put back after, so one test's slip does
    not fail the tests after it in the worker. Autouse and set up first, so it is torn down after
    every other fixture of the test (monkeypatch's undo included)."""
    import torch._dynamo.config  # noqa: F401  the config modules a compile reads, imported before the test
    import torch._functorch.config  # noqa: F401
    import torch._inductor.config  # noqa: F401
    from tracer.capture.process_state import changed_config_entries, restore_config_states, torch_config_states
    before = torch_config_states()
    yield
    changed = changed_config_entries(before)
    restore_config_states(before)            # the tests after this one run on the configs they expect
    if changed:
        pytest.fail(f"{request.node.nodeid} left torch config entries changed: {', '.join(changed)} "
                    "(change a torch config with its config.patch(...), which undoes itself)", pytrace=False)
