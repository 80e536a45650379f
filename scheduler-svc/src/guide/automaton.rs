//! A compiled structured output: a DFA over the output's bytes, and for each state the model's
//! tokens that keep the text on a path the DFA can still accept (computed the first time a
//! sequence reaches the state, then shared by every sequence of the same pattern).

use std::collections::{HashMap, HashSet};
use std::fmt;
use std::sync::{Arc, Mutex};

use regex_automata::dfa::{dense, Automaton, StartKind};
use regex_automata::nfa::thompson;
use regex_automata::util::primitives::StateID;
use regex_automata::util::start;
use regex_automata::{Anchored, MatchKind};
use regex_syntax::hir::{Hir, Look};

use super::vocabulary::GuideVocabulary;
use super::GuideError;

/// Bytes of DFA a pattern may build into (and use while determinizing): a pattern whose DFA
/// blows up (`(\w+\s?){1,200}`, an array of ten `format: email` strings) is refused instead of
/// holding the server's memory. Measured on a 2-vCPU Xeon: refusing `(\w+\s?){1,200}` took
/// ~5 s at 16 MB, 23 s at 32 MB, ~45 s at 64 MB, while an object of one email, one URI and one
/// date-time needed 64 MB (1.5 s) — a dense DFA is the wrong tool for such schemas (a lazy one,
/// determinized as sequences walk it, would be the fix); until then they are refused quickly.
pub const DFA_SIZE_LIMIT: usize = 16 << 20;

/// Bytes of masks a guide keeps (6 KiB each for a 49k vocabulary: 2730 states); past that they
/// are dropped and recomputed as sequences reach them again.
pub const MAX_MASK_BYTES: usize = 16 << 20;

/// What a sequence may choose in one state of its guide.
#[derive(Debug)]
pub struct StateMask {
    /// Bit `id % 64` of word `id / 64`: the vocabulary's tokens allowed.
    pub tokens: Box<[u64]>,
    /// Whether any token is allowed (else only an end of the output is).
    pub continues: bool,
    /// Whether the text so far is a whole output, which may end here.
    pub complete: bool,
}

/// A pattern compiled against the vocabulary.
pub struct Guide {
    pattern: String,
    dfa: dense::DFA<Vec<u32>>,
    start: StateID,
    vocabulary: Arc<GuideVocabulary>,
    masks: Mutex<HashMap<StateID, Arc<StateMask>>>,
    /// The states from which some text leads to a match. Most live states can, but not all:
    /// after `x` in `x$y|z` the DFA is not dead, yet nothing completes it.
    finishable: HashSet<StateID>,
}

impl Guide {
    /// `pattern` (a regular expression the whole output must match) against `vocabulary`.
    pub fn compile(pattern: String, vocabulary: Arc<GuideVocabulary>) -> Result<Self, GuideError> {
        // Anchored at both ends, on the parsed pattern (text around it could be escaped from:
        // `a)|(b`, or commented out under `(?x)`): the output must match whole, and a DFA state
        // can be a match state only at the end of the text (no delayed matches to tell apart).
        let parsed = regex_syntax::parse(&pattern).map_err(|error| GuideError::Pattern(error.to_string()))?;
        let whole = Hir::concat(vec![parsed, Hir::look(Look::End)]);
        // The NFA is bounded too: `a{100000000}` would otherwise take gigabytes before the DFA's
        // own limit is ever checked.
        let nfa = thompson::Compiler::new()
            .configure(thompson::Config::new().nfa_size_limit(Some(DFA_SIZE_LIMIT)))
            .build_from_hir(&whole)
            .map_err(|error| GuideError::Pattern(with_causes(&error)))?;
        let config = dense::Config::new()
            .match_kind(MatchKind::All)
            .start_kind(StartKind::Anchored)
            .dfa_size_limit(Some(DFA_SIZE_LIMIT))
            .determinize_size_limit(Some(DFA_SIZE_LIMIT));
        let dfa = dense::Builder::new()
            .configure(config)
            .build_from_nfa(&nfa)
            .map_err(|error| GuideError::Pattern(with_causes(&error)))?;
        let start = dfa
            .start_state(&start::Config::new().anchored(Anchored::Yes))
            .map_err(|error| GuideError::Pattern(error.to_string()))?;
        let finishable = finishable_states(&dfa, start);
        if !finishable.contains(&start) {
            // An output could only end at once, not matching (`[^\s\S]`, `a$b`, `"enum": []`).
            return Err(GuideError::Unmatchable);
        }
        Ok(Self {
            pattern,
            dfa,
            start,
            vocabulary,
            masks: Mutex::new(HashMap::new()),
            finishable,
        })
    }

    /// Whether the empty text is a whole match (no JSON value is).
    pub fn matches_empty(&self) -> bool {
        self.dfa.is_match_state(self.dfa.next_eoi_state(self.start))
    }

    /// Where every output starts.
    pub fn start(&self) -> GuideState {
        GuideState(Some(self.start))
    }

    /// The state after `bytes` from `state`: `GuideState` of `None` once the text can no
    /// longer become a match (a token the mask did not allow).
    pub fn advance(&self, state: GuideState, bytes: &[u8]) -> GuideState {
        let mut current = match state.0 {
            Some(current) => current,
            None => return state,
        };
        for &byte in bytes {
            match self.step(current, byte) {
                Some(next) => current = next,
                None => return GuideState(None),
            }
        }
        GuideState(Some(current))
    }

    /// What may be chosen in `state` (a refused state allows nothing but an end).
    pub fn mask(&self, state: GuideState) -> Arc<StateMask> {
        let Some(id) = state.0 else {
            return Arc::new(StateMask {
                tokens: vec![0; self.vocabulary.mask_words()].into_boxed_slice(),
                continues: false,
                complete: false,
            });
        };
        if let Some(mask) = self.masks.lock().unwrap_or_else(|e| e.into_inner()).get(&id) {
            return Arc::clone(mask);
        }
        // Computed outside the lock: two sequences reaching a new state at once compute it
        // twice rather than one waiting on the other.
        let (tokens, continues) =
            self.vocabulary
                .allowed(id, |state, byte| self.step(state, byte), |state| self.can_finish(state));
        let mask = Arc::new(StateMask {
            tokens,
            continues,
            complete: self.dfa.is_match_state(self.dfa.next_eoi_state(id)),
        });
        let mut masks = self.masks.lock().unwrap_or_else(|e| e.into_inner());
        if (masks.len() + 1) * self.vocabulary.mask_words() * 8 > MAX_MASK_BYTES {
            masks.clear();
        }
        masks.insert(id, Arc::clone(&mask));
        mask
    }

    fn can_finish(&self, state: StateID) -> bool {
        self.finishable.contains(&state)
    }

    fn step(&self, state: StateID, byte: u8) -> Option<StateID> {
        let next = self.dfa.next_state(state, byte);
        (!self.dfa.is_dead_state(next) && !self.dfa.is_quit_state(next)).then_some(next)
    }
}

/// The states reachable from `start` from which some text leads to a match: every reachable
/// state and its edges (one byte of each of the DFA's byte classes), then back from the states
/// whose end of text is a match.
fn finishable_states(dfa: &dense::DFA<Vec<u32>>, start: StateID) -> HashSet<StateID> {
    let bytes: Vec<u8> = dfa
        .byte_classes()
        .representatives(..)
        .filter_map(|unit| unit.as_u8())
        .collect();
    let mut index = HashMap::from([(start, 0usize)]);
    let (mut states, mut comes_from) = (vec![start], vec![Vec::new()]);
    let mut next_unvisited = 0;
    while let Some(&state) = states.get(next_unvisited) {
        for &byte in &bytes {
            let next = dfa.next_state(state, byte);
            if dfa.is_dead_state(next) || dfa.is_quit_state(next) {
                continue;
            }
            let target = *index.entry(next).or_insert_with(|| {
                states.push(next);
                comes_from.push(Vec::new());
                states.len() - 1
            });
            comes_from[target].push(next_unvisited);
        }
        next_unvisited += 1;
    }
    let mut finishable = vec![false; states.len()];
    let mut pending: Vec<usize> = (0..states.len())
        .filter(|&i| dfa.is_match_state(dfa.next_eoi_state(states[i])))
        .collect();
    for &i in &pending {
        finishable[i] = true;
    }
    while let Some(i) = pending.pop() {
        for &before in &comes_from[i] {
            if !finishable[before] {
                finishable[before] = true;
                pending.push(before);
            }
        }
    }
    states
        .into_iter()
        .zip(finishable)
        .filter(|(_, yes)| *yes)
        .map(|(state, _)| state)
        .collect()
}

/// `error` and what caused it (regex-automata's own message is only "error building NFA"; the
/// parse error under it says where the pattern is wrong).
fn with_causes(error: &dyn std::error::Error) -> String {
    let mut message = error.to_string();
    let mut cause = error.source();
    while let Some(inner) = cause {
        message = format!("{message}: {inner}");
        cause = inner.source();
    }
    message
}

impl fmt::Debug for Guide {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_struct("Guide")
            .field("pattern", &self.pattern)
            .finish_non_exhaustive()
    }
}

/// Two guides are the same when they hold the same pattern.
impl PartialEq for Guide {
    fn eq(&self, other: &Self) -> bool {
        self.pattern == other.pattern
    }
}

/// Where a sequence's output is in its guide's automaton; `None` once a token left every path
/// to a match (which the masks prevent: only an end may follow then).
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
pub struct GuideState(Option<StateID>);

/// A sequence's guide and its place in it.
#[derive(Debug, Clone)]
pub struct GuideCursor {
    pub guide: Arc<Guide>,
    pub state: GuideState,
}

impl GuideCursor {
    pub fn new(guide: Arc<Guide>) -> Self {
        let state = guide.start();
        Self { guide, state }
    }

    /// Moves past a chosen token of `bytes` (a special token's are empty: the output ends there).
    pub fn advance(&mut self, bytes: &[u8]) {
        self.state = self.guide.advance(self.state, bytes);
    }

    pub fn mask(&self) -> Arc<StateMask> {
        self.guide.mask(self.state)
    }
}
