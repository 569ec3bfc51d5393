"""Step 13: the weights on huge pages (huge_pages.place, and tinyllm.load's huge_pages)."""

import copy

import pytest
import torch

import tinyllm
from tinyllm.build import load
from tinyllm.core.generate import generate
from tinyllm.ext import huge_pages

THP = huge_pages.mode() in ("madvise", "always")  # the system hands out huge pages


@pytest.fixture(scope="module")
def plain():
    """The bundled model in float64, where the loader put it."""
    return tinyllm.load(device="cpu", dtype=torch.float64)[0]


def test_place_moves_every_weight_equal_and_keeps_the_tied_head_one_tensor(plain):
    model = copy.deepcopy(plain)
    before = {name: t.clone() for name, t in model.state_dict(keep_vars=True).items()}
    where = {name: t.data_ptr() for name, t in model.state_dict(keep_vars=True).items()}
    assert model.lm_head.weight is model.embed_tokens.weight  # the bundled model ties them
    moved = huge_pages.place(model)
    assert moved >= sum(t.nbytes for t in model.parameters())
    after = model.state_dict(keep_vars=True)
    assert after.keys() == before.keys()
    for name, t in after.items():
        assert torch.equal(t, before[name]), name
        assert t.data_ptr() != where[name], f"{name} was not moved"
        assert t.untyped_storage().nbytes() == t.nbytes, f"{name} shares a storage"
    assert model.lm_head.weight is model.embed_tokens.weight, "the tied head came apart"
    assert isinstance(model.lm_head.weight, torch.nn.Parameter)
    assert {p.data_ptr() for p in model.parameters()} <= {t.data_ptr() for t in after.values()}


def test_a_placed_model_lies_on_huge_pages_where_the_system_has_them(plain):
    model = copy.deepcopy(plain)
    huge_pages.place(model)
    behind = huge_pages.backed(model.embed_tokens.weight)  # 12 MiB: several whole huge pages
    if THP:
        assert behind >= huge_pages.HUGE_PAGE, f"mode {huge_pages.mode()}: no huge page behind"
    else:
        assert behind == 0


def test_a_placed_model_computes_what_it_did(plain):
    model = copy.deepcopy(plain)
    huge_pages.place(model)
    prompt = [5, 17, 3, 9, 22]
    assert generate(model, prompt, 12) == generate(plain, prompt, 12)
    ids = torch.tensor([prompt])
    assert torch.equal(model(ids)[0], plain(ids)[0])


def test_a_copy_of_a_placed_model_copies_each_weight_alone(plain):
    model = copy.deepcopy(plain)
    huge_pages.place(model)
    twin = copy.deepcopy(model)
    for (name, t), u in zip(model.state_dict().items(), twin.state_dict().values()):
        assert torch.equal(t, u) and t.data_ptr() != u.data_ptr(), name
        assert u.untyped_storage().nbytes() == u.nbytes, f"{name}: the copy holds the block"


def test_the_builders_load_places_a_cpu_model_when_asked(plain):
    """tinyllm.load leaves the weights where the loader put them; tinyllm.build.load with
    huge_pages=True moves them into 2 MB pages (step 13's switch)."""
    placed = load(device="cpu", dtype=torch.float64, huge_pages=True)[0]
    head = placed.lm_head.weight
    assert torch.equal(head, plain.lm_head.weight)
    assert head.untyped_storage().nbytes() == head.nbytes  # its own storage, over the block
    assert (huge_pages.backed(head) > 0) == THP
    assert (huge_pages.backed(plain.lm_head.weight) > 0) == (huge_pages.mode() == "always")


def test_load_refuses_a_huge_pages_that_is_not_a_bool():
    with pytest.raises(ValueError, match="huge_pages must be True or False, got 'yes'"):
        load(device="cpu", huge_pages="yes")


def test_an_empty_tensor_is_a_block_of_its_own():
    t = huge_pages.empty(3 * huge_pages.HUGE_PAGE // 4, torch.float32)  # 3 huge pages
    assert t.shape == (3 * huge_pages.HUGE_PAGE // 4,) and t.dtype == torch.float32
    assert t.data_ptr() % huge_pages.HUGE_PAGE == 0
    t.fill_(1.0)
    assert t.sum().item() == t.numel()
    assert (huge_pages.backed(t) >= 3 * huge_pages.HUGE_PAGE) == THP
