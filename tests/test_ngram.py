"""The n-gram drafter's votes: every earlier occurrence of the context's last n-grams votes for what followed
it (longer matches weigh more), the datastore breaks ties; chains take the best path, trees the best nodes."""

import pytest

from draft_service.proposers.base import ProposeTask
from draft_service.proposers.datastore import NgramDatastore
from draft_service.proposers.ngram import NgramProposer
from specdec.core import tree
from specdec.core.tree import TreeShape


def paths(tokens, parents):
    out = []
    for i in range(len(tokens)):
        p, node = [], i
        while node >= 0:
            p.append(tokens[node])
            node = parents[node]
        out.append(tuple(reversed(p)))
    return out


def test_a_recurring_continuation_outvotes_the_latest_one():
    p = NgramProposer(vocab_size=64)
    # After 7 came 8 twice, then 9 once (most recently): two votes beat one; between (8, 1) and (8, 2) the
    # more recent wins the tie.
    assert p.lookup([7, 8, 1, 7, 8, 2, 7, 9, 3, 7], 2) == [8, 2]
    # A 2-token match outweighs several 1-token ones.
    assert p.lookup([5, 7, 9, 6, 7, 8, 6, 7, 8, 6, 7, 8, 5, 7], 1) == [9]


def test_tree_branches_where_the_matches_disagree():
    p = NgramProposer(vocab_size=64)
    tokens, parents = p.lookup_tree([1, 2, 3, 1, 2, 4, 1, 2, 5, 1, 2], budget=6, max_depth=3)
    assert tokens == [5, 4, 3, 1, 1, 1] and parents == [-1, -1, -1, 0, 1, 2]  # most recent first on ties
    tree.check_parents(parents, len(tokens))


@pytest.mark.parametrize("budget, depth", [(1, 1), (3, 8), (6, 2), (16, 16)])
def test_tree_respects_budget_and_depth_and_is_a_trie(budget, depth):
    import random

    rng = random.Random(budget * 100 + depth)
    context = [rng.randrange(6) for _ in range(80)]
    store = NgramDatastore.build([([rng.randrange(6) for _ in range(50)], 0)], max_n=3)
    tokens, parents = NgramProposer(vocab_size=8, datastore=store).lookup_tree(context, budget, depth)
    assert 1 <= len(tokens) <= budget
    assert max(tree.depths(tree.check_parents(parents, len(tokens)))) < depth
    assert len(set(paths(tokens, parents))) == len(tokens), "no two siblings may carry the same token"
    chain = NgramProposer(vocab_size=8, datastore=store).lookup(context, depth)
    assert tuple(chain[:1]) in paths(tokens, parents), "the tree holds the chain's first token"


def test_datastore_fills_in_and_breaks_ties():
    store = NgramDatastore.build([([1, 2, 3, 40, 41, 42, 7, 8, 50, 51], 0)], max_n=2)
    p = NgramProposer(vocab_size=64, datastore=store)
    assert p.lookup([5, 6, 3], 3) == [40, 41, 42]  # no context match: the table's chain
    assert p.lookup([7, 8, 9, 7, 8], 3) == [9, 7, 8]  # any context match outweighs the table (7 8 -> 50)
    # After 3 came 40 and (more recently) 9, one vote each: the table's 3 -> 40 breaks the tie.
    assert p.lookup([3, 40, 3, 9, 3], 3) == [40, 3, 9]
    assert NgramProposer(vocab_size=64).lookup([3, 40, 3, 9, 3], 3) == [9, 3]


def test_get_tree_syncs_the_session_like_get_candidates():
    from specdec.core.sampling import SamplingParams

    p = NgramProposer(vocab_size=64)
    t = p.get_tree("s", 0, [1, 2, 3, 1, 2, 4, 1, 2], TreeShape(budget=4, max_depth=2), SamplingParams(), 0, 0)
    assert t.cached_len == 8 and t.probs_fp16 is None and len(t.tokens) == 4
    assert max(tree.depths(t.parents)) < 2
    t = p.get_tree("s", 7, [5], TreeShape(budget=4), SamplingParams(), 0, 1)  # a rejected last token replaced
    assert t.cached_len == 8 and p.session_tokens("s")[-1] == 5


def test_each_drafted_token_carries_the_votes_for_its_path():
    from specdec.core.sampling import SamplingParams

    p = NgramProposer(vocab_size=64)
    context = [7, 8, 1, 7, 8, 2, 7, 9, 3, 7]
    path, votes = p.lookup_scored(context, 3)
    assert path == p.lookup(context, 3) == [8, 2, 7]
    # (7 -> 8) is voted by two 1-token matches of 8 each; (8, 2) by one of them; a longer path never scores more
    assert votes == [16.0, 8.0, 8.0] and votes == sorted(votes, reverse=True)
    got = p.get_candidates(ProposeTask("s", 0, context, 3, SamplingParams(), 0, 0))
    assert got.tokens == path and got.scores == votes
    assert p.lookup_scored([1, 2, 3], 4) == ([], [])  # no match, no draft
