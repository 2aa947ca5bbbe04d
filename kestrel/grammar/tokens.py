"""Which tokens a grammar allows next: a pattern's automaton (`kestrel.grammar.regex`) walked over the whole
vocabulary at once.

Legend: V the vocabulary (the model's logits width).

`Vocabulary` holds the tokens' bytes as a trie, level by level (a level: the distinct prefixes of one length,
grouped by parent). `Grammar.allowed(state)` walks it from an automaton state one level at a time, only below
the prefixes still alive (numpy gathers from the transitions computed so far; the automaton makes the missing
ones): by masks over the whole level where most of it lives (inside a JSON string), by runs of the live nodes'
children where few do (a schema's keys and punctuation). It keeps each state's mask: a generation revisits few
states. EOS is allowed where the pattern is complete; special tokens never are, but for a thinking model's
`<think>` and `</think>` (a constraint's thought ends with the model's own).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Callable
from dataclasses import dataclass

import numpy as np

from kestrel.grammar.regex import Automaton

# Masks kept a grammar: V bytes each, at most this many bytes (and at least 64 masks); with GrammarCache's 64
# grammars, at most 1 GiB of host memory for K3's 163,840-token vocabulary.
MASK_CACHE_BYTES = 16 << 20
# Bytes a new grammar's probe tries first at each step of its walk (`Grammar._probe`)
_PROBE_BYTES = b'a0 "{[,:.-_Az9}]\n'
_PROBE_DEPTH = 128


@dataclass
class _Level:
    """One depth of the vocabulary's byte trie: its nodes' last bytes, the tokens ending at each (a run of
    token_ids), and each node's children (a run of the next level's nodes)."""

    byte: np.ndarray  # [nodes] int64
    parent: np.ndarray  # [nodes] int64: each node's parent in the level above (sorted)
    token_ids: np.ndarray  # [tokens ending at this depth] int64, by node
    token_node: np.ndarray  # [tokens ending at this depth] int64: the node each ends at (sorted)
    first_token: np.ndarray  # [nodes] int64
    num_tokens: np.ndarray  # [nodes] int64
    first_child: np.ndarray  # [nodes] int64, into the next level
    num_children: np.ndarray  # [nodes] int64


def _runs(first: np.ndarray, count: np.ndarray) -> tuple[np.ndarray, np.ndarray]:
    """The indices of the runs [first[k], first[k] + count[k]) back to back, and for each the run's k."""
    total = int(count.sum())
    which = np.repeat(np.arange(len(count)), count)
    starts = np.cumsum(count) - count
    return first[which] + np.arange(total) - starts[which], which


class Vocabulary:
    """The tokens as bytes. token_bytes[i]: what id i writes (b"" for ids a grammar never allows: special tokens
    and ids past the tokenizer's); eos_ids: the ids that end a complete output."""

    def __init__(self, token_bytes: list[bytes], eos_ids: tuple[int, ...]):
        self.size = len(token_bytes)  # V
        self.eos_ids = tuple(i for i in eos_ids if 0 <= i < self.size)
        self.token_bytes = token_bytes
        # The tokens' byte prefixes as a trie, level by level (depth 0: at most 256 nodes, where the tokens are V).
        index: list[dict[bytes, int]] = []
        byte: list[list[int]] = []
        parent: list[list[int]] = []
        # per depth: (token ids, their node) of the tokens ending there
        ends: list[tuple[list[int], list[int]]] = []
        for i, b in enumerate(token_bytes):
            for j in range(len(b)):
                if j == len(index):
                    index.append({})
                    byte.append([])
                    parent.append([])
                    ends.append(([], []))
                key = b[: j + 1]
                node = index[j].get(key)
                if node is None:
                    node = index[j][key] = len(byte[j])
                    byte[j].append(b[j])
                    parent[j].append(index[j - 1][b[:j]] if j else 0)
            if b:
                ends[len(b) - 1][0].append(i)
                ends[len(b) - 1][1].append(index[len(b) - 1][b])
        # Each level's nodes renumbered by parent, so that a node's children are one run of the level below
        # (`first_child`, `num_children`; the root's are all of level 0) and the tokens ending at it one run of
        # `token_ids` (`first_token`, `num_tokens`): a walk visits only the children of the prefixes still alive.
        # (It had visited every node of every level: a JSON schema's state lets few through, and on a 150,000-token
        # vocabulary such a walk took 3 ms.)
        self.levels: list[_Level] = []
        renumber = np.zeros(1, dtype=np.int64)  # the level above's first-seen node ids -> their new ids
        for j in range(len(byte)):
            par = renumber[np.array(parent[j], dtype=np.int64)]
            order = np.argsort(par, kind="stable")
            renumber = np.empty(len(order), dtype=np.int64)
            renumber[order] = np.arange(len(order))
            par = par[order]
            tok_node = renumber[np.array(ends[j][1], dtype=np.int64)]
            by_node = np.argsort(tok_node, kind="stable")
            num_tokens = np.bincount(tok_node, minlength=len(order))
            if self.levels:  # the level above's children: this level's runs by parent
                above = self.levels[-1]
                above.num_children = np.bincount(par, minlength=len(above.byte))
                above.first_child = np.cumsum(above.num_children) - above.num_children
            self.levels.append(
                _Level(
                    byte=np.array(byte[j], dtype=np.int64)[order],
                    parent=par,
                    token_ids=np.array(ends[j][0], dtype=np.int64)[by_node],
                    token_node=tok_node[by_node],
                    first_token=np.cumsum(num_tokens) - num_tokens,
                    num_tokens=num_tokens,
                    first_child=np.zeros(len(order), dtype=np.int64),  # (none below the last level)
                    num_children=np.zeros(len(order), dtype=np.int64),
                )
            )

    @classmethod
    def of(cls, tokenizer, size: int, eos_ids: tuple[int, ...]) -> Vocabulary:
        """A tokenizer's vocabulary as the model's logits see it (`size` wide: ids past the tokenizer's are never
        allowed). The tokenizer's special ids (`special_token_ids`) and the EOS ids write nothing, but for a
        thinking model's `<think>` and `</think>` (special tokens in some tokenizers): a constraint's thought
        (`StructuredOutputsParams.thought`) ends with the model's own `</think>`."""
        markers = (b"<think>", b"</think>")
        special = {i for i in tokenizer.special_token_ids() if tokenizer.token_bytes(i) not in markers}
        special |= set(eos_ids)
        known = min(size, tokenizer.vocab_size)
        data = [b"" if i in special else tokenizer.token_bytes(i) for i in range(known)]
        return cls(data + [b""] * (size - known), eos_ids)


class Grammar:
    """A pattern over a vocabulary: `start`, `allowed(state)` (a [V] bool mask), `advance(state, token)`,
    `is_complete(state)`. States are the automaton's; 0 is dead."""

    def __init__(self, pattern: str, vocab: Vocabulary):
        self.pattern = pattern
        self.automaton = Automaton(pattern)
        self.vocab = vocab
        self.start = self.automaton.start
        self._masks: OrderedDict[int, np.ndarray] = OrderedDict()
        self._max_masks = max(64, MASK_CACHE_BYTES // max(vocab.size, 1))
        self._complete: dict[int, bool] = {}
        self.num_masks_made = (
            0  # (walks over the vocabulary so far: `bench decode --sampling grammar` reports them)
        )
        self._probe()

    def _probe(self) -> None:
        """Walk a path of the pattern's automaton, so that a pattern too ambiguous to follow (PatternError from
        `Automaton.next`) is found when it is compiled, as a request's error, not tokens into its output: at
        each step the first byte of _PROBE_BYTES (then of all bytes) that keeps a match possible."""
        a, state = self.automaton, self.automaton.start
        for _ in range(_PROBE_DEPTH):
            live = next((t for b in _PROBE_BYTES if (t := a.next(state, b)) != 0), 0)
            if live == 0:
                return
            state = live

    def allowed(self, state: int) -> np.ndarray:
        """[V] bool: the tokens that keep the output a prefix of a match (EOS where it is a match). A state from
        which no token can go on but that is not a match yet (a vocabulary lacking the bytes it needs) allows
        EOS, so that the output ends rather than loops."""
        mask = self._masks.get(state)
        if mask is not None:
            self._masks.move_to_end(state)
            return mask
        ok = np.zeros(self.vocab.size, dtype=bool)
        levels = self.vocab.levels
        # the nodes to try at the current depth, each with the state its parent reached (the root's children are
        # all of level 0; the dead state 0 has none)
        nodes = np.arange(len(levels[0].byte) if levels and state != 0 else 0)
        states = np.full(len(nodes), state, dtype=np.int64)
        for depth, level in enumerate(levels):
            if not len(nodes):
                break
            states = self._lookup(states, level.byte[nodes])  # the state after each node's byte (0: dead)
            live = states != 0
            nodes, states = nodes[live], states[live]
            below = levels[depth + 1] if depth + 1 < len(levels) else None
            if 8 * len(nodes) >= len(level.byte):
                # most of the level alive (inside a JSON string, nearly all): by masks over the whole level
                state_of = np.zeros(len(level.byte), dtype=np.int64)
                state_of[nodes] = states
                ok[level.token_ids] = state_of[level.token_node] != 0
                if below is not None:
                    states = state_of[below.parent]
                    nodes = np.flatnonzero(states)
                    states = states[nodes]
            else:  # a few alive (a schema's keys and punctuation): by runs below the live nodes alone
                ends, _ = _runs(level.first_token[nodes], level.num_tokens[nodes])
                ok[level.token_ids[ends]] = True
                if below is not None:
                    nodes, parent = _runs(level.first_child[nodes], level.num_children[nodes])
                    states = states[parent]
        complete = self.automaton.accepting(state)
        if complete or not ok.any():
            ok[list(self.vocab.eos_ids)] = True
        self._masks[state] = ok
        self.num_masks_made += 1
        if len(self._masks) > self._max_masks:
            self._masks.popitem(last=False)
        return ok

    def advance(self, state: int, token: int) -> int:
        """The state after `token` (EOS and the other special tokens leave it as it is)."""
        for b in self.vocab.token_bytes[token] if 0 <= token < self.vocab.size else b"":
            state = self.automaton.next(state, b)
        return state

    def is_complete(self, state: int) -> bool:
        """A match that no token can extend: only EOS can follow."""
        found = self._complete.get(state)
        if found is None:
            eos = len(set(self.vocab.eos_ids))
            found = self._complete[state] = (
                self.automaton.accepting(state) and int(self.allowed(state).sum()) == eos
            )
        return found

    def _lookup(self, states: np.ndarray, col: np.ndarray) -> np.ndarray:
        """[n] next states of (states[k], col[k]) from the automaton's table, its missing rows made first."""
        a = self.automaton
        nxt = a.table[states, col]
        missing = nxt < 0
        if missing.any():
            for state in np.unique(states[missing]).tolist():
                a.fill(state)
            nxt = a.table[states, col]
        return nxt


class GrammarCache:
    """Compiled grammars by pattern (the last `size` used), over one vocabulary made on first use. Thread-safe:
    the server compiles a request's grammar when it checks the request, the engine's thread reads it."""

    def __init__(self, vocabulary: Callable[[], Vocabulary], size: int = 64):
        self._make_vocabulary = vocabulary
        self._vocab: Vocabulary | None = None
        self._grammars: OrderedDict[str, Grammar] = OrderedDict()
        self._size = size
        self._lock = threading.Lock()

    def get(self, pattern: str) -> Grammar:
        """The grammar of `pattern`; PatternError where it does not compile."""
        with self._lock:
            found = self._grammars.get(pattern)
            if found is not None:
                self._grammars.move_to_end(pattern)
                return found
            if self._vocab is None:
                self._vocab = self._make_vocabulary()
            vocab = self._vocab
        grammar = Grammar(pattern, vocab)  # outside the lock: a large pattern takes a while
        with self._lock:
            grammar = self._grammars.setdefault(pattern, grammar)
            if len(self._grammars) > self._size:
                self._grammars.popitem(last=False)
        return grammar
