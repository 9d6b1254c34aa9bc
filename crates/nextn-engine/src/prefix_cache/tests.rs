use nextn_model::cache::KvLayer;
use nextn_model::{KvRows, KvType};

use super::{PrefixTree, Weighed};

#[derive(Debug, PartialEq)]
struct Snap(&'static str);

impl Weighed for Snap {
    fn bytes(&self) -> usize {
        100
    }
}

/// One attention layer of width 1 whose row at position p of `tokens` is `1000·p + token`.
fn layer(tokens: &[u32]) -> KvLayer {
    let mut kv = KvLayer::new(KvType::F32, KvType::F32, 1, 1);
    for (p, &t) in tokens.iter().enumerate() {
        let x = [(1000 * p) as f32 + t as f32];
        kv.push(&x, &x);
    }
    kv
}

fn insert(tree: &mut PrefixTree<Snap>, tokens: &[u32], name: &'static str) {
    let kv = layer(tokens);
    let inserted: Result<(), std::convert::Infallible> =
        tree.insert(tokens, |s, e| Ok(vec![kv.rows(s, e)]), Snap(name));
    let Ok(()) = inserted;
}

/// The lookup's position, snapshot and whether its rows are the prompt's.
fn lookup(
    tree: &mut PrefixTree<Snap>,
    prompt: &[u32],
    max_pos: usize,
) -> Option<(usize, &'static str)> {
    let hit = tree.lookup(prompt, max_pos, |_| true)?;
    let mut got = KvLayer::new(KvType::F32, KvType::F32, 1, 1);
    for seg in &hit.segments {
        assert_eq!(seg.len(), 1);
        got.append_rows(&seg[0]).unwrap();
    }
    let want: KvRows = layer(prompt).rows(0, hit.n_past);
    assert_eq!(got.rows(0, hit.n_past), want, "rows of the resumed prefix");
    Some((hit.n_past, hit.snapshot.0))
}

fn rows_bytes(n: usize) -> usize {
    // f32 K and V of width 1, and the token ids.
    n * 8 + n * 4
}

#[test]
fn lookups_resume_at_the_deepest_snapshot_on_the_path() {
    let mut t = PrefixTree::new(usize::MAX);
    insert(&mut t, &[1, 2, 3, 4, 5], "a");
    assert_eq!(lookup(&mut t, &[1, 2, 3, 4, 5, 6], 5), Some((5, "a")));
    // The snapshot lies beyond what the prompt may resume from.
    assert_eq!(lookup(&mut t, &[1, 2, 3, 4, 5], 4), None);
    assert_eq!(lookup(&mut t, &[1, 2, 3, 4, 7, 7], 5), None);
    // A branch splits the edge; the common part has no snapshot of its own.
    insert(&mut t, &[1, 2, 3, 9, 9], "b");
    assert_eq!(lookup(&mut t, &[1, 2, 3, 9, 9, 1], 5), Some((5, "b")));
    assert_eq!(lookup(&mut t, &[1, 2, 3, 4, 5, 1], 5), Some((5, "a")));
    assert_eq!(lookup(&mut t, &[1, 2, 3, 7], 3), None);
    insert(&mut t, &[1, 2, 3], "c");
    assert_eq!(lookup(&mut t, &[1, 2, 3, 7], 3), Some((3, "c")));
    assert_eq!(lookup(&mut t, &[1, 2, 3, 9, 9, 1], 4), Some((3, "c")));
    // Deeper, through two nodes.
    insert(&mut t, &[1, 2, 3, 9, 9, 8, 8], "d");
    assert_eq!(lookup(&mut t, &[1, 2, 3, 9, 9, 8, 8, 0], 7), Some((7, "d")));
    // Replacing a snapshot keeps one.
    insert(&mut t, &[1, 2, 3], "c2");
    assert_eq!(t.snapshots(), 4);
    assert_eq!(lookup(&mut t, &[1, 2, 3, 0], 3), Some((3, "c2")));
    // Rows are held once: 7 distinct positions along the branches, 4 snapshots.
    assert_eq!(
        t.bytes(),
        rows_bytes(5) + rows_bytes(2) + rows_bytes(2) + 4 * 100
    );
}

#[test]
fn the_least_recently_used_leaf_goes_first_with_its_bare_ancestors() {
    // Room for two 5-token entries with snapshots, not three.
    let entry = rows_bytes(5) + 100;
    let mut t = PrefixTree::new(2 * entry + 10);
    insert(&mut t, &[1, 1, 1, 1, 1], "a");
    insert(&mut t, &[2, 2, 2, 2, 2], "b");
    assert_eq!(lookup(&mut t, &[1, 1, 1, 1, 1, 0], 5), Some((5, "a")));
    insert(&mut t, &[3, 3, 3, 3, 3], "c");
    assert_eq!(t.evictions(), 1);
    assert_eq!(lookup(&mut t, &[2, 2, 2, 2, 2, 0], 5), None);
    assert_eq!(lookup(&mut t, &[1, 1, 1, 1, 1, 0], 5), Some((5, "a")));
    assert_eq!(lookup(&mut t, &[3, 3, 3, 3, 3, 0], 5), Some((5, "c")));
    assert!(t.bytes() <= 2 * entry + 10);

    // Evicting the only leaf under a node without a snapshot removes that node too.
    let mut t = PrefixTree::new(usize::MAX);
    insert(&mut t, &[5, 5, 5, 1], "x");
    insert(&mut t, &[5, 5, 5, 2], "y");
    let before = t.bytes();
    t.budget = before - 1;
    t.evict_to_budget();
    t.budget = rows_bytes(1) + 100 + 1;
    t.evict_to_budget();
    assert_eq!(t.bytes(), 0);
    assert_eq!(t.snapshots(), 0);
    assert_eq!(lookup(&mut t, &[5, 5, 5, 2, 0], 4), None);
}

#[test]
fn an_older_state_inside_the_tree_goes_before_another_sequences_latest() {
    // Conversation "a" moves on from a1 (inside the tree) to a2; conversation "b" is stored
    // after a1. Under pressure a1 goes first, alone: its rows stay for a2's path.
    let mut t = PrefixTree::new(usize::MAX);
    insert(&mut t, &[1, 1, 1], "a1");
    insert(&mut t, &[2, 2, 2], "b");
    insert(&mut t, &[1, 1, 1, 1, 1], "a2");
    t.budget = t.bytes() - 1;
    t.evict_to_budget();
    assert_eq!(t.evictions(), 1);
    assert_eq!(t.snapshots(), 2);
    assert_eq!(lookup(&mut t, &[1, 1, 1, 9], 3), None);
    assert_eq!(lookup(&mut t, &[1, 1, 1, 1, 1, 9], 5), Some((5, "a2")));
    assert_eq!(lookup(&mut t, &[2, 2, 2, 9], 3), Some((3, "b")));
    assert_eq!(t.bytes(), rows_bytes(5) + rows_bytes(3) + 2 * 100);
}
