import pytest
import torch

from tracer.models import ZOO, zoo_entry


def _count(name):
    with torch.device("meta"):
        model = zoo_entry(name).build_model()
    return sum(p.numel() for p in model.parameters())


@pytest.mark.parametrize("name,expected", [
    ("llama-88m", 88_096_512),
    ("llama-7b", 6_738_415_616),
    ("llama-405b", 405_853_388_800),           # Llama 3.1 405B's published count
    ("gpt2-124m", 124_439_808),
    ("gpt2-355m", 354_823_168),
    ("gpt2-774m", 774_030_080),
    ("gpt2-1558m", 1_557_611_200),
])
def test_parameter_counts(name, expected):
    assert _count(name) == expected


def test_every_name_has_a_debug_flavour_that_is_tiny():
    for name in ZOO:
        if not name.endswith("-debug"):
            assert f"{name}-debug" in ZOO
            assert _count(f"{name}-debug") < 1_000_000


def test_unknown_name_lists_valid_ones():
    with pytest.raises(KeyError, match="llama-88m"):
        zoo_entry("llama-3b")
