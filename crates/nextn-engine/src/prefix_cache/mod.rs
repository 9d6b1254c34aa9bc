//! The prefix cache's store: a radix tree keyed by token ids.
//!
//! Each node owns the tokens of its edge and the attention rows of those positions, so the rows
//! of a prefix are held once however many cached sequences continue it. A node may also hold a
//! *snapshot* at its end position: the rest of a sequence's state there (recurrent states, the
//! head's), without which a sequence cannot resume at that position, since recurrent states cannot
//! be truncated. A lookup therefore resumes at the deepest snapshot on the prompt's path, not at
//! the end of the common prefix. Every leaf holds a snapshot; eviction removes the least recently
//! used leaf, then any ancestor left without a snapshot or children, until the tree fits its
//! byte budget.

use std::collections::HashMap;

use nextn_model::{ImageSpan, KvRows, RecurrentSnapshot};

use crate::speculative::draft::HeadState;

/// What a snapshot weighs, for the budget.
pub trait Weighed {
    fn bytes(&self) -> usize;
}

/// A sequence's state at a cached position besides its attention rows: the recurrent states,
/// the NextN head's state when the sequence kept one, and the images among its rows (for a slot
/// file of it; a request resuming here brings its own).
#[derive(Clone, Debug)]
pub struct Snapshot {
    pub recurrent: RecurrentSnapshot,
    pub head: Option<HeadState>,
    pub images: Vec<ImageSpan>,
}

impl Weighed for Snapshot {
    fn bytes(&self) -> usize {
        self.recurrent.bytes()
            + self.head.as_ref().map_or(0, HeadState::bytes)
            + self.images.len() * std::mem::size_of::<ImageSpan>()
    }
}

struct Node<S> {
    parent: usize,
    /// Position of the edge's first token.
    start: usize,
    tokens: Vec<u32>,
    /// Attention rows of the edge's positions, one entry per attention layer.
    rows: Vec<KvRows>,
    snapshot: Option<S>,
    children: HashMap<u32, usize>,
    /// When a path through this node was last stored or resumed.
    last_used: u64,
    /// When the snapshot was last stored or resumed from.
    snapshot_used: u64,
}

impl<S: Weighed> Node<S> {
    fn end(&self) -> usize {
        self.start + self.tokens.len()
    }

    fn bytes(&self) -> usize {
        self.tokens.len() * 4
            + self.rows.iter().map(KvRows::bytes).sum::<usize>()
            + self.snapshot.as_ref().map_or(0, Weighed::bytes)
    }
}

/// Where a prompt can resume: `n_past` positions, the attention rows of `0..n_past` in order (one
/// slice of per-layer rows per node on the path) and the snapshot at `n_past`.
pub struct Hit<'t, S> {
    pub n_past: usize,
    pub segments: Vec<&'t [KvRows]>,
    pub snapshot: &'t S,
}

pub struct PrefixTree<S> {
    nodes: Vec<Option<Node<S>>>,
    free: Vec<usize>,
    budget: usize,
    bytes: usize,
    clock: u64,
    evictions: u64,
}

const ROOT: usize = 0;

impl<S: Weighed> PrefixTree<S> {
    /// An empty tree that holds at most `budget` bytes.
    pub fn new(budget: usize) -> Self {
        PrefixTree {
            nodes: vec![Some(Node {
                parent: ROOT,
                start: 0,
                tokens: Vec::new(),
                rows: Vec::new(),
                snapshot: None,
                children: HashMap::new(),
                last_used: 0,
                snapshot_used: 0,
            })],
            free: Vec::new(),
            budget,
            bytes: 0,
            clock: 0,
            evictions: 0,
        }
    }

    /// Bytes held (tokens, attention rows and snapshots).
    pub fn bytes(&self) -> usize {
        self.bytes
    }

    /// Snapshots held.
    pub fn snapshots(&self) -> usize {
        self.nodes
            .iter()
            .flatten()
            .filter(|n| n.snapshot.is_some())
            .count()
    }

    /// Nodes removed to stay within the budget so far.
    pub fn evictions(&self) -> u64 {
        self.evictions
    }

    fn node(&self, i: usize) -> &Node<S> {
        self.nodes[i].as_ref().expect("a live node")
    }

    fn node_mut(&mut self, i: usize) -> &mut Node<S> {
        self.nodes[i].as_mut().expect("a live node")
    }

    /// The deepest snapshot at a position `<= max_pos` on the path of `tokens` (the prompt) for
    /// which `usable` holds; its path counts as used.
    pub fn lookup(
        &mut self,
        tokens: &[u32],
        max_pos: usize,
        usable: impl Fn(&S) -> bool,
    ) -> Option<Hit<'_, S>> {
        let mut path = Vec::new();
        let mut best = None;
        let mut at = ROOT;
        loop {
            let n = self.node(at);
            if n.snapshot.as_ref().is_some_and(&usable) && n.end() <= max_pos && at != ROOT {
                best = Some(path.len());
            }
            let pos = n.end();
            let Some(&child) = tokens.get(pos).and_then(|t| n.children.get(t)) else {
                break;
            };
            let c = self.node(child);
            let whole = tokens.len() >= c.end() && tokens[pos..c.end()] == c.tokens[..];
            if !whole {
                break;
            }
            path.push(child);
            at = child;
        }
        let depth = best?;
        self.clock += 1;
        let now = self.clock;
        for &i in &path[..depth] {
            self.node_mut(i).last_used = now;
        }
        self.node_mut(path[depth - 1]).snapshot_used = now;
        let path = &path[..depth];
        let last = self.node(path[depth - 1]);
        Some(Hit {
            n_past: last.end(),
            segments: path.iter().map(|&i| self.node(i).rows.as_slice()).collect(),
            snapshot: last.snapshot.as_ref().expect("chosen for its snapshot"),
        })
    }

    /// Keep `snapshot` at position `tokens.len()` of the sequence `tokens`. `rows(start, end)`
    /// gives the attention rows of positions the tree does not hold yet. An existing snapshot
    /// there is replaced. Then the least recently used entries are evicted until the tree fits.
    /// When `rows` fails (a read from the device) nothing is kept and its error is returned.
    pub fn insert<E>(
        &mut self,
        tokens: &[u32],
        mut rows: impl FnMut(usize, usize) -> Result<Vec<KvRows>, E>,
        snapshot: S,
    ) -> Result<(), E> {
        if tokens.is_empty() {
            return Ok(());
        }
        self.clock += 1;
        let now = self.clock;
        let mut at = ROOT;
        loop {
            self.node_mut(at).last_used = now;
            let pos = self.node(at).end();
            if pos == tokens.len() {
                break;
            }
            let Some(&child) = self.node(at).children.get(&tokens[pos]) else {
                let node = Node {
                    parent: at,
                    start: pos,
                    tokens: tokens[pos..].to_vec(),
                    rows: rows(pos, tokens.len())?,
                    snapshot: None,
                    children: HashMap::new(),
                    last_used: now,
                    snapshot_used: now,
                };
                let i = self.add(node);
                self.node_mut(at).children.insert(tokens[pos], i);
                at = i;
                break;
            };
            let c = self.node(child);
            let common = c
                .tokens
                .iter()
                .zip(&tokens[pos..])
                .take_while(|(a, b)| a == b)
                .count();
            if common < c.tokens.len() {
                self.split(child, common);
            }
            // The child (or, after a split, the node of the common part) continues the path.
            at = self.node(at).children[&tokens[pos]];
        }
        let n = self.node_mut(at);
        n.snapshot_used = now;
        let old = n.snapshot.replace(snapshot);
        let added = n.snapshot.as_ref().map_or(0, Weighed::bytes);
        self.bytes = self.bytes + added - old.map_or(0, |s| s.bytes());
        self.evict_to_budget();
        Ok(())
    }

    fn add(&mut self, node: Node<S>) -> usize {
        self.bytes += node.bytes();
        match self.free.pop() {
            Some(i) => {
                self.nodes[i] = Some(node);
                i
            }
            None => {
                self.nodes.push(Some(node));
                self.nodes.len() - 1
            }
        }
    }

    /// Cut node `i`'s edge after `k` tokens: a new node takes the first `k` (and the parent's
    /// link), `i` keeps the rest (and its snapshot and children).
    fn split(&mut self, i: usize, k: usize) {
        self.bytes -= self.node(i).bytes();
        let n = self.node_mut(i);
        let tail_tokens = n.tokens.split_off(k);
        let head_tokens = std::mem::replace(&mut n.tokens, tail_tokens);
        let mut head_rows = std::mem::take(&mut n.rows);
        n.rows = head_rows.iter_mut().map(|r| r.split_off(k)).collect();
        let (parent, start, last_used) = (n.parent, n.start, n.last_used);
        n.start = start + k;
        let first_tail = n.tokens[0];
        let first_head = head_tokens[0];
        self.bytes += self.node(i).bytes();
        let h = self.add(Node {
            parent,
            start,
            tokens: head_tokens,
            rows: head_rows,
            snapshot: None,
            children: HashMap::from([(first_tail, i)]),
            last_used,
            snapshot_used: 0,
        });
        self.node_mut(i).parent = h;
        self.node_mut(parent).children.insert(first_head, h);
    }

    fn remove(&mut self, i: usize) {
        let n = self.nodes[i].take().expect("a live node");
        self.bytes -= n.bytes();
        let first = n.tokens[0];
        self.node_mut(n.parent).children.remove(&first);
        self.free.push(i);
        self.evictions += 1;
    }

    /// Evict the least recently used snapshot until the tree fits: a leaf goes with its rows
    /// (and any ancestor left bare); a snapshot inside the tree, an older state of a sequence
    /// that has moved on, goes alone, and its rows stay for the paths through it.
    fn evict_to_budget(&mut self) {
        while self.bytes > self.budget {
            let victim = self
                .nodes
                .iter()
                .enumerate()
                .filter_map(|(i, n)| n.as_ref().map(|n| (i, n)))
                .filter(|(i, n)| *i != ROOT && (n.children.is_empty() || n.snapshot.is_some()))
                .min_by_key(|(_, n)| match n.snapshot {
                    Some(_) => n.snapshot_used,
                    None => n.last_used,
                })
                .map(|(i, _)| i);
            let Some(mut i) = victim else {
                return;
            };
            if !self.node(i).children.is_empty() {
                let dropped = self.node_mut(i).snapshot.take();
                self.bytes -= dropped.map_or(0, |s| s.bytes());
                self.evictions += 1;
                continue;
            }
            loop {
                let parent = self.node(i).parent;
                self.remove(i);
                let p = self.node(parent);
                if parent == ROOT || !p.children.is_empty() || p.snapshot.is_some() {
                    break;
                }
                i = parent;
            }
        }
    }
}

#[cfg(test)]
mod tests;
