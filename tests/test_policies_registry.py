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


def test_torchtitan_keeps_every_mm_but_every_second_one_counted_per_region():
    spec = PolicySpec(name="selective", save="torchtitan")
    keep = save_predicate(spec)
    ops = ["aten.mm.default", "aten.silu.default", "aten.mm.default", "aten.mm.default",
           "aten._scaled_dot_product_flash_attention.default", "_c10d_functional.reduce_scatter_tensor.default",
           "aten.addmm.default"]
    assert [keep(op) for op in ops] == [True, False, False, True, True, True, False]
    fresh = save_predicate(spec)                        # the next region counts from zero
    assert [fresh("aten.mm.default"), fresh("aten.mm.default")] == [True, False]


def test_the_report_names_the_selective_policy():
    from tracer.policies import save_policy_label

    def my_policy(ctx, op, *args, **kwargs):
        return False
    assert save_policy_label(PolicySpec(name="selective", save_fn=my_policy)) == "the policy function " + my_policy.__qualname__
    assert save_policy_label(PolicySpec(name="selective", save="matmul", model_save_fn_unused=True)) == \
        "--save-policy matmul (given explicitly: the model file's save_policy() is not used)"
