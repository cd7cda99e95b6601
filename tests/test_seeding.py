"""Derived seeds are part of every run's record: a resumed run, an eval with ``--seed``
and the vLLM client's per-request seeds must draw what they drew before. These values
were produced by the two copies this function replaced (``retool.rollout.derive_seed``
and the vLLM client's ``digest``); they must never change."""

from retool.seeding import context_digest, derive_seed

CONTEXT = context_digest([1, 2, 3])


def test_seeds_are_the_recorded_values():
    assert derive_seed(42) == 3518515243436047752
    assert derive_seed(42, "fork") == 3535622906714153996  # a group's fork request (rollout)
    assert derive_seed(7, 0, 1) == 2982179078620627907  # (run seed, step, round, index) style
    assert derive_seed(b"42", b"p1") == 2514236295826046674  # eval's per-problem seed
    assert derive_seed(b"42", CONTEXT, b"0") == 1536460369067409598  # eval's per-request seed
    assert derive_seed(3, 5, CONTEXT, 0) == 4709133248713729752  # the vLLM client's per-request seed
    assert derive_seed(123456789, 2) == 6121445846294990370  # the vLLM client's per-sample seed


def test_parts_are_length_prefixed_and_typed_by_their_text():
    assert derive_seed(1, 23) != derive_seed(12, 3)
    assert derive_seed(1, 2) == derive_seed("1", b"2")  # str() of anything that is not bytes
    assert 0 <= derive_seed() < 2**63
    assert CONTEXT == context_digest((1, 2, 3)) != context_digest([1, 23])
