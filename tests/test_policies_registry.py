import pytest

from tracer.errors import UsageError
from tracer.policies import SAVE_POLICIES, PolicySpec, save_policy, save_predicate


def test_default_selective_policy_keeps_matmuls_and_attention():
    keep = save_predicate(PolicySpec(name="selective"))
    assert keep("aten.mm.default") and keep("aten._scaled_dot_product_flash_attention_for_cpu.default")
    assert not keep("aten.silu.default") and not keep("aten.mul.Tensor")


def test_save_ops_override_the_named_policy():
    keep = save_predicate(PolicySpec(name="selective", save_ops=("mm", "aten.silu")))
    assert keep("aten.mm.default") and keep("aten.silu.default") and not keep("aten.bmm.default")


def test_unknown_policy_lists_valid_names_and_duplicates_are_refused():
    with pytest.raises(UsageError) as info:
        save_predicate(PolicySpec(name="selective", save="most"))
    assert all(name in str(info.value) for name in SAVE_POLICIES)
    with pytest.raises(ValueError):
        save_policy("matmul")(lambda target: True)
