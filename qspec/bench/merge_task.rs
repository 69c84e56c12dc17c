//! Utilities for working with sorted slices.
//!
//! This module collects the small algorithms we keep rewriting across the
//! indexing, scheduling and reporting crates: binary searches that return
//! insertion points instead of `Result`, galloping search for skewed inputs,
//! set operations on sorted slices (with both set and multiset semantics),
//! run-length helpers, a `SortedVec` wrapper that keeps its invariant, a
//! k-way merge over many sorted sources and a few order statistics.
//!
//! Every function documents the ordering it expects. Unless stated
//! otherwise, "sorted" means non-decreasing according to `Ord`, duplicates
//! are allowed, and the functions do not allocate more than their output.
//!
//! # Conventions
//!
//! * Functions that take two slices call them `a` and `b` and never mutate
//!   them.
//! * Functions that return an index return an *insertion point*: a value in
//!   `0..=len` such that inserting there keeps the slice sorted.
//! * Multiset operations keep duplicates: an element that appears `m` times
//!   in `a` and `n` times in `b` appears `min(m, n)` times in the
//!   intersection, `max(m, n)` times in the union and `m - min(m, n)` times
//!   in the difference.
//! * Set operations (`*_dedup`) treat each slice as a set and return a
//!   strictly increasing `Vec`.
//!
//! # Examples
//!
//! ```
//! use sorted_slices::search::{lower_bound, upper_bound};
//!
//! let xs = [1, 2, 2, 2, 5, 8];
//! assert_eq!(lower_bound(&xs, &2), 1);
//! assert_eq!(upper_bound(&xs, &2), 4);
//! assert_eq!(lower_bound(&xs, &9), xs.len());
//! ```

#![forbid(unsafe_code)]
#![warn(missing_docs)]

use std::cmp::Ordering;
use std::collections::BinaryHeap;
use std::cmp::Reverse;
use std::fmt;
use std::iter::FusedIterator;
use std::ops::{Bound, RangeBounds};

/// Checks on the ordering of a slice.
pub mod check {
    /// Returns `true` if `xs` is sorted in non-decreasing order.
    ///
    /// An empty slice and a slice with one element are sorted.
    ///
    /// ```
    /// use sorted_slices::check::is_sorted;
    /// assert!(is_sorted(&[1, 1, 2, 3]));
    /// assert!(!is_sorted(&[3, 2]));
    /// ```
    pub fn is_sorted<T: Ord>(xs: &[T]) -> bool {
        xs.windows(2).all(|w| w[0] <= w[1])
    }

    /// Returns `true` if `xs` is sorted in strictly increasing order,
    /// that is, sorted and free of duplicates.
    pub fn is_strictly_sorted<T: Ord>(xs: &[T]) -> bool {
        xs.windows(2).all(|w| w[0] < w[1])
    }

    /// Returns `true` if `xs` is sorted according to the key function `key`.
    pub fn is_sorted_by_key<T, K, F>(xs: &[T], mut key: F) -> bool
    where
        K: Ord,
        F: FnMut(&T) -> K,
    {
        let mut iter = xs.iter();
        let mut prev = match iter.next() {
            Some(x) => key(x),
            None => return true,
        };
        for x in iter {
            let k = key(x);
            if k < prev {
                return false;
            }
            prev = k;
        }
        true
    }

    /// Returns the index of the first element that is smaller than its
    /// predecessor, or `None` if the slice is sorted.
    ///
    /// Useful in error messages: "input is not sorted at index 17".
    ///
    /// ```
    /// use sorted_slices::check::first_unsorted;
    /// assert_eq!(first_unsorted(&[1, 4, 3, 5]), Some(2));
    /// assert_eq!(first_unsorted(&[1, 2, 3]), None);
    /// ```
    pub fn first_unsorted<T: Ord>(xs: &[T]) -> Option<usize> {
        xs.windows(2).position(|w| w[0] > w[1]).map(|i| i + 1)
    }

    /// Length of the longest sorted prefix of `xs`.
    pub fn sorted_prefix_len<T: Ord>(xs: &[T]) -> usize {
        first_unsorted(xs).unwrap_or(xs.len())
    }

    /// Number of descents (`xs[i] > xs[i + 1]`) in `xs`.
    ///
    /// A sorted slice has no descents; a slice sorted in reverse without
    /// duplicates has `len - 1`. Adaptive sorts use this to pick a strategy.
    pub fn count_descents<T: Ord>(xs: &[T]) -> usize {
        xs.windows(2).filter(|w| w[0] > w[1]).count()
    }
}

/// Binary and galloping searches that return insertion points.
pub mod search {
    use std::cmp::Ordering;

    /// Index of the first element of `xs` that is not less than `x`.
    ///
    /// `xs` must be sorted. Returns `xs.len()` if every element is less
    /// than `x`. This is C++'s `std::lower_bound`.
    ///
    /// ```
    /// use sorted_slices::search::lower_bound;
    /// assert_eq!(lower_bound(&[10, 20, 20, 30], &20), 1);
    /// assert_eq!(lower_bound(&[10, 20, 20, 30], &25), 3);
    /// ```
    pub fn lower_bound<T: Ord>(xs: &[T], x: &T) -> usize {
        lower_bound_by(xs, |y| y.cmp(x))
    }

    /// Index of the first element of `xs` that is greater than `x`.
    ///
    /// `xs` must be sorted. Returns `xs.len()` if no element is greater.
    pub fn upper_bound<T: Ord>(xs: &[T], x: &T) -> usize {
        upper_bound_by(xs, |y| y.cmp(x))
    }

    /// `lower_bound` with a comparator that orders an element against the
    /// probe: it must return `Less` for elements before the probe.
    pub fn lower_bound_by<T, F>(xs: &[T], mut cmp: F) -> usize
    where
        F: FnMut(&T) -> Ordering,
    {
        let mut lo = 0usize;
        let mut hi = xs.len();
        while lo < hi {
            // `lo + (hi - lo) / 2` cannot overflow, unlike `(lo + hi) / 2`.
            let mid = lo + (hi - lo) / 2;
            match cmp(&xs[mid]) {
                Ordering::Less => lo = mid + 1,
                Ordering::Equal | Ordering::Greater => hi = mid,
            }
        }
        lo
    }

    /// `upper_bound` with a comparator, see [`lower_bound_by`].
    pub fn upper_bound_by<T, F>(xs: &[T], mut cmp: F) -> usize
    where
        F: FnMut(&T) -> Ordering,
    {
        let mut lo = 0usize;
        let mut hi = xs.len();
        while lo < hi {
            let mid = lo + (hi - lo) / 2;
            match cmp(&xs[mid]) {
                Ordering::Less | Ordering::Equal => lo = mid + 1,
                Ordering::Greater => hi = mid,
            }
        }
        lo
    }

    /// `lower_bound` on a key extracted from each element.
    pub fn lower_bound_by_key<T, K, F>(xs: &[T], key: &K, mut f: F) -> usize
    where
        K: Ord,
        F: FnMut(&T) -> K,
    {
        lower_bound_by(xs, |y| f(y).cmp(key))
    }

    /// The half-open range of indices whose elements equal `x`.
    ///
    /// The range is empty (and starts at the insertion point) when `x` is
    /// absent.
    ///
    /// ```
    /// use sorted_slices::search::equal_range;
    /// let xs = [1, 3, 3, 3, 7];
    /// assert_eq!(equal_range(&xs, &3), 1..4);
    /// assert_eq!(equal_range(&xs, &4), 4..4);
    /// ```
    pub fn equal_range<T: Ord>(xs: &[T], x: &T) -> std::ops::Range<usize> {
        let lo = lower_bound(xs, x);
        // Search only the tail: everything before `lo` is smaller than `x`.
        let hi = lo + upper_bound(&xs[lo..], x);
        lo..hi
    }

    /// Number of occurrences of `x` in the sorted slice `xs`, in
    /// `O(log n)` time.
    pub fn count<T: Ord>(xs: &[T], x: &T) -> usize {
        equal_range(xs, x).len()
    }

    /// Returns `true` if the sorted slice `xs` contains `x`.
    pub fn contains<T: Ord>(xs: &[T], x: &T) -> bool {
        let i = lower_bound(xs, x);
        i < xs.len() && xs[i] == *x
    }

    /// Galloping (exponential) search for the lower bound of `x`, starting
    /// at index `start`.
    ///
    /// Probes `start`, `start + 1`, `start + 3`, `start + 7`, ... until it
    /// overshoots, then finishes with a binary search inside the last gap.
    /// The cost is `O(log d)` where `d` is the distance from `start` to the
    /// answer, which makes it the right tool when walking two slices of very
    /// different lengths: the short one drives, the long one gallops.
    ///
    /// The result is never smaller than `start`; elements before `start`
    /// are assumed to be less than `x`.
    pub fn gallop_lower_bound<T: Ord>(xs: &[T], x: &T, start: usize) -> usize {
        let n = xs.len();
        if start >= n || xs[start] >= *x {
            return start.min(n);
        }
        // Invariant: xs[lo] < x.
        let mut lo = start;
        let mut step = 1usize;
        let mut hi = start + step;
        while hi < n && xs[hi] < *x {
            lo = hi;
            step = step.saturating_mul(2);
            hi = lo.saturating_add(step);
        }
        let hi = hi.min(n);
        lo + 1 + lower_bound(&xs[lo + 1..hi], x)
    }

    /// Galloping search for the upper bound of `x`, see
    /// [`gallop_lower_bound`].
    pub fn gallop_upper_bound<T: Ord>(xs: &[T], x: &T, start: usize) -> usize {
        let n = xs.len();
        if start >= n || xs[start] > *x {
            return start.min(n);
        }
        // Invariant: xs[lo] <= x.
        let mut lo = start;
        let mut step = 1usize;
        let mut hi = start + step;
        while hi < n && xs[hi] <= *x {
            lo = hi;
            step = step.saturating_mul(2);
            hi = lo.saturating_add(step);
        }
        let hi = hi.min(n);
        lo + 1 + upper_bound(&xs[lo + 1..hi], x)
    }

    /// Index of the element closest to `x` in the sorted slice `xs`, or
    /// `None` if `xs` is empty. Ties go to the smaller element.
    ///
    /// ```
    /// use sorted_slices::search::nearest;
    /// assert_eq!(nearest(&[1, 4, 9], 6), Some(1));
    /// assert_eq!(nearest(&[1, 4, 9], 7), Some(2));
    /// assert_eq!(nearest(&[], 7), None);
    /// ```
    pub fn nearest(xs: &[i64], x: i64) -> Option<usize> {
        if xs.is_empty() {
            return None;
        }
        let i = lower_bound(xs, &x);
        if i == 0 {
            return Some(0);
        }
        if i == xs.len() {
            return Some(xs.len() - 1);
        }
        let below = x.abs_diff(xs[i - 1]);
        let above = xs[i].abs_diff(x);
        Some(if below <= above { i - 1 } else { i })
    }

    /// Partition point of a predicate that is `true` for a prefix of `xs`
    /// and `false` for the rest: the index of the first `false`.
    pub fn partition_point<T, P>(xs: &[T], mut pred: P) -> usize
    where
        P: FnMut(&T) -> bool,
    {
        lower_bound_by(xs, |y| if pred(y) { Ordering::Less } else { Ordering::Greater })
    }
}

/// Set and multiset operations on sorted slices.
///
/// All functions run in `O(len(a) + len(b))` time and allocate only the
/// returned `Vec`, reserved up front from an upper bound on its length.
pub mod set_ops {
    use std::cmp::Ordering;

    /// Multiset intersection: each value appears `min(m, n)` times.
    ///
    /// ```
    /// use sorted_slices::set_ops::intersection;
    /// assert_eq!(intersection(&[1, 2, 2, 3], &[2, 2, 2, 4]), vec![2, 2]);
    /// ```
    pub fn intersection(a: &[i32], b: &[i32]) -> Vec<i32> {
        let mut out = Vec::with_capacity(a.len().min(b.len()));
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                Ordering::Less => i += 1,
                Ordering::Greater => j += 1,
                Ordering::Equal => {
                    out.push(a[i]);
                    i += 1;
                    j += 1;
                }
            }
        }
        out
    }

    /// Multiset difference `a - b`: each value appears `m - min(m, n)`
    /// times.
    ///
    /// ```
    /// use sorted_slices::set_ops::difference;
    /// assert_eq!(difference(&[1, 2, 2, 3], &[2, 4]), vec![1, 2, 3]);
    /// ```
    pub fn difference(a: &[i32], b: &[i32]) -> Vec<i32> {
        let mut out = Vec::with_capacity(a.len());
        let (mut i, mut j) = (0, 0);
        while i < a.len() {
            if j == b.len() {
                out.extend_from_slice(&a[i..]);
                break;
            }
            match a[i].cmp(&b[j]) {
                Ordering::Less => {
                    out.push(a[i]);
                    i += 1;
                }
                Ordering::Greater => j += 1,
                Ordering::Equal => {
                    i += 1;
                    j += 1;
                }
            }
        }
        out
    }

    /// Multiset union: each value appears `max(m, n)` times.
    ///
    /// Note that this is *not* a merge: a merge keeps `m + n` copies.
    ///
    /// ```
    /// use sorted_slices::set_ops::union;
    /// assert_eq!(union(&[1, 2, 2], &[2, 3]), vec![1, 2, 2, 3]);
    /// ```
    pub fn union(a: &[i32], b: &[i32]) -> Vec<i32> {
        let mut out = Vec::with_capacity(a.len() + b.len());
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                Ordering::Less => {
                    out.push(a[i]);
                    i += 1;
                }
                Ordering::Greater => {
                    out.push(b[j]);
                    j += 1;
                }
                Ordering::Equal => {
                    out.push(a[i]);
                    i += 1;
                    j += 1;
                }
            }
        }
        out.extend_from_slice(&a[i..]);
        out.extend_from_slice(&b[j..]);
        out
    }

    /// Multiset symmetric difference: each value appears `|m - n|` times.
    pub fn symmetric_difference(a: &[i32], b: &[i32]) -> Vec<i32> {
        let mut out = Vec::with_capacity(a.len() + b.len());
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                Ordering::Less => {
                    out.push(a[i]);
                    i += 1;
                }
                Ordering::Greater => {
                    out.push(b[j]);
                    j += 1;
                }
                Ordering::Equal => {
                    i += 1;
                    j += 1;
                }
            }
        }
        out.extend_from_slice(&a[i..]);
        out.extend_from_slice(&b[j..]);
        out
    }

    /// Set intersection: the distinct values present in both slices, in
    /// increasing order.
    pub fn intersection_dedup(a: &[i32], b: &[i32]) -> Vec<i32> {
        let mut out: Vec<i32> = Vec::new();
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                Ordering::Less => i += 1,
                Ordering::Greater => j += 1,
                Ordering::Equal => {
                    if out.last() != Some(&a[i]) {
                        out.push(a[i]);
                    }
                    i += 1;
                    j += 1;
                }
            }
        }
        out
    }

    /// Set union: the distinct values present in either slice, in
    /// increasing order.
    ///
    /// ```
    /// use sorted_slices::set_ops::union_dedup;
    /// assert_eq!(union_dedup(&[1, 1, 3], &[1, 2, 3, 3]), vec![1, 2, 3]);
    /// ```
    pub fn union_dedup(a: &[i32], b: &[i32]) -> Vec<i32> {
        let mut out: Vec<i32> = Vec::with_capacity(a.len() + b.len());
        let (mut i, mut j) = (0, 0);
        let push = |out: &mut Vec<i32>, x: i32| {
            if out.last() != Some(&x) {
                out.push(x);
            }
        };
        while i < a.len() && j < b.len() {
            if a[i] <= b[j] {
                push(&mut out, a[i]);
                i += 1;
            } else {
                push(&mut out, b[j]);
                j += 1;
            }
        }
        for &x in &a[i..] {
            push(&mut out, x);
        }
        for &x in &b[j..] {
            push(&mut out, x);
        }
        out
    }

    /// Intersection for very unbalanced inputs: walks the shorter slice and
    /// gallops through the longer one.
    ///
    /// Runs in `O(m log(n / m))` for `m = min(len)`, `n = max(len)`, which
    /// beats the linear walk once one slice is about 32 times longer.
    /// Produces exactly the same output as [`intersection`].
    pub fn intersection_galloping(a: &[i32], b: &[i32]) -> Vec<i32> {
        let (short, long) = if a.len() <= b.len() { (a, b) } else { (b, a) };
        let mut out = Vec::with_capacity(short.len());
        let mut pos = 0usize;
        let mut k = 0usize;
        while k < short.len() {
            let x = short[k];
            // How many copies of `x` the short side has.
            let run = short[k..].iter().take_while(|&&y| y == x).count();
            let lo = crate::search::gallop_lower_bound(long, &x, pos);
            let hi = crate::search::gallop_upper_bound(long, &x, lo);
            let n = run.min(hi - lo);
            out.extend(std::iter::repeat_n(x, n));
            pos = hi;
            k += run;
            if pos >= long.len() {
                break;
            }
        }
        out
    }

    /// Returns `true` if every element of `a` (with multiplicity) occurs in
    /// `b`, i.e. `a` is a sub-multiset of `b`.
    pub fn is_subset(a: &[i32], b: &[i32]) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < a.len() {
            if j == b.len() {
                return false;
            }
            match a[i].cmp(&b[j]) {
                Ordering::Less => return false,
                Ordering::Greater => j += 1,
                Ordering::Equal => {
                    i += 1;
                    j += 1;
                }
            }
        }
        true
    }

    /// Returns `true` if the two sorted slices share no value.
    pub fn is_disjoint(a: &[i32], b: &[i32]) -> bool {
        let (mut i, mut j) = (0, 0);
        while i < a.len() && j < b.len() {
            match a[i].cmp(&b[j]) {
                Ordering::Less => i += 1,
                Ordering::Greater => j += 1,
                Ordering::Equal => return false,
            }
        }
        true
    }
}

/// Duplicates and runs of equal elements.
pub mod runs {
    /// Removes consecutive duplicates from a sorted `Vec` in place and
    /// returns the number of elements removed.
    ///
    /// Equivalent to `Vec::dedup`, but reports how much it removed, which
    /// the statistics code wants.
    pub fn dedup_sorted(xs: &mut Vec<i32>) -> usize {
        let before = xs.len();
        xs.dedup();
        before - xs.len()
    }

    /// Distinct values of a sorted slice together with their counts.
    ///
    /// ```
    /// use sorted_slices::runs::run_lengths;
    /// assert_eq!(run_lengths(&[1, 1, 2, 5, 5, 5]), vec![(1, 2), (2, 1), (5, 3)]);
    /// ```
    pub fn run_lengths(xs: &[i32]) -> Vec<(i32, usize)> {
        let mut out: Vec<(i32, usize)> = Vec::new();
        for &x in xs {
            match out.last_mut() {
                Some((v, n)) if *v == x => *n += 1,
                _ => out.push((x, 1)),
            }
        }
        out
    }

    /// Expands `(value, count)` pairs back into a sorted `Vec`.
    ///
    /// The inverse of [`run_lengths`] when the values are increasing.
    pub fn expand_runs(runs: &[(i32, usize)]) -> Vec<i32> {
        let total: usize = runs.iter().map(|&(_, n)| n).sum();
        let mut out = Vec::with_capacity(total);
        for &(v, n) in runs {
            out.extend(std::iter::repeat_n(v, n));
        }
        out
    }

    /// The value with the most occurrences in a sorted slice and its count.
    /// Ties go to the smallest value. Returns `None` for an empty slice.
    pub fn mode(xs: &[i32]) -> Option<(i32, usize)> {
        let mut best: Option<(i32, usize)> = None;
        let mut i = 0;
        while i < xs.len() {
            let x = xs[i];
            let mut j = i + 1;
            while j < xs.len() && xs[j] == x {
                j += 1;
            }
            let n = j - i;
            if best.is_none_or(|(_, m)| n > m) {
                best = Some((x, n));
            }
            i = j;
        }
        best
    }

    /// An iterator over maximal runs of equal elements, yielding sub-slices.
    ///
    /// ```
    /// use sorted_slices::runs::Runs;
    /// let xs = [4, 4, 6, 9, 9];
    /// let runs: Vec<&[i32]> = Runs::new(&xs).collect();
    /// assert_eq!(runs, vec![&[4, 4][..], &[6][..], &[9, 9][..]]);
    /// ```
    #[derive(Debug, Clone)]
    pub struct Runs<'a, T> {
        rest: &'a [T],
    }

    impl<'a, T: PartialEq> Runs<'a, T> {
        /// Runs of `xs`; `xs` need not be sorted, equal neighbours form a run.
        pub fn new(xs: &'a [T]) -> Self {
            Runs { rest: xs }
        }
    }

    impl<'a, T: PartialEq> Iterator for Runs<'a, T> {
        type Item = &'a [T];

        fn next(&mut self) -> Option<Self::Item> {
            let first = self.rest.first()?;
            let n = self.rest.iter().take_while(|x| *x == first).count();
            let (run, rest) = self.rest.split_at(n);
            self.rest = rest;
            Some(run)
        }

        fn size_hint(&self) -> (usize, Option<usize>) {
            if self.rest.is_empty() {
                (0, Some(0))
            } else {
                (1, Some(self.rest.len()))
            }
        }
    }

    impl<'a, T: PartialEq> std::iter::FusedIterator for Runs<'a, T> {}
}

/// A `Vec` that stays sorted.
///
/// Insertion and removal cost `O(n)` because of the shift, lookups cost
/// `O(log n)`. For the few thousand elements our callers keep (open file
/// handles, pending deadlines, shard boundaries) this beats a `BTreeSet` on
/// both memory and iteration speed, and it allows duplicates.
#[derive(Clone, PartialEq, Eq, Hash, Default)]
pub struct SortedVec<T> {
    items: Vec<T>,
}

impl<T: Ord> SortedVec<T> {
    /// An empty `SortedVec`.
    pub fn new() -> Self {
        SortedVec { items: Vec::new() }
    }

    /// An empty `SortedVec` with room for `n` elements.
    pub fn with_capacity(n: usize) -> Self {
        SortedVec { items: Vec::with_capacity(n) }
    }

    /// Sorts `items` and wraps them. Uses a stable sort so equal elements
    /// keep their relative order, which matters for `T` with a partial key.
    pub fn from_unsorted(mut items: Vec<T>) -> Self {
        items.sort();
        SortedVec { items }
    }

    /// Wraps an already sorted `Vec`.
    ///
    /// # Errors
    ///
    /// Returns the `Vec` back, together with the index of the first element
    /// out of order, if it is not sorted.
    pub fn from_sorted(items: Vec<T>) -> Result<Self, (Vec<T>, usize)> {
        match crate::check::first_unsorted(&items) {
            None => Ok(SortedVec { items }),
            Some(i) => Err((items, i)),
        }
    }

    /// Number of elements.
    pub fn len(&self) -> usize {
        self.items.len()
    }

    /// Returns `true` if there are no elements.
    pub fn is_empty(&self) -> bool {
        self.items.is_empty()
    }

    /// The elements, in order.
    pub fn as_slice(&self) -> &[T] {
        &self.items
    }

    /// Unwraps the sorted `Vec`.
    pub fn into_vec(self) -> Vec<T> {
        self.items
    }

    /// Inserts `x` after any elements equal to it and returns its index.
    pub fn insert(&mut self, x: T) -> usize {
        let i = crate::search::upper_bound(&self.items, &x);
        self.items.insert(i, x);
        i
    }

    /// Inserts `x` unless an equal element is present. Returns the index of
    /// the new element, or `Err` with the index of the existing one.
    pub fn insert_unique(&mut self, x: T) -> Result<usize, usize> {
        let i = crate::search::lower_bound(&self.items, &x);
        if i < self.items.len() && self.items[i] == x {
            return Err(i);
        }
        self.items.insert(i, x);
        Ok(i)
    }

    /// Removes one element equal to `x` (the first) and returns it.
    pub fn remove_one(&mut self, x: &T) -> Option<T> {
        let i = crate::search::lower_bound(&self.items, x);
        if i < self.items.len() && self.items[i] == *x {
            Some(self.items.remove(i))
        } else {
            None
        }
    }

    /// Removes every element equal to `x` and returns how many there were.
    pub fn remove_all(&mut self, x: &T) -> usize {
        let r = crate::search::equal_range(&self.items, x);
        let n = r.len();
        self.items.drain(r);
        n
    }

    /// Returns `true` if an element equal to `x` is present.
    pub fn contains(&self, x: &T) -> bool {
        crate::search::contains(&self.items, x)
    }

    /// Number of elements equal to `x`.
    pub fn count(&self, x: &T) -> usize {
        crate::search::count(&self.items, x)
    }

    /// The smallest element.
    pub fn first(&self) -> Option<&T> {
        self.items.first()
    }

    /// The largest element.
    pub fn last(&self) -> Option<&T> {
        self.items.last()
    }

    /// Removes and returns the largest element.
    pub fn pop_last(&mut self) -> Option<T> {
        self.items.pop()
    }

    /// The sub-slice of elements within `range`.
    ///
    /// ```
    /// use sorted_slices::SortedVec;
    /// let v = SortedVec::from_unsorted(vec![5, 1, 3, 9, 7]);
    /// assert_eq!(v.range(3..8), &[3, 5, 7]);
    /// assert_eq!(v.range(..=3), &[1, 3]);
    /// ```
    pub fn range<R: RangeBounds<T>>(&self, range: R) -> &[T] {
        let start = match range.start_bound() {
            Bound::Included(x) => crate::search::lower_bound(&self.items, x),
            Bound::Excluded(x) => crate::search::upper_bound(&self.items, x),
            Bound::Unbounded => 0,
        };
        let end = match range.end_bound() {
            Bound::Included(x) => crate::search::upper_bound(&self.items, x),
            Bound::Excluded(x) => crate::search::lower_bound(&self.items, x),
            Bound::Unbounded => self.items.len(),
        };
        if start >= end {
            &[]
        } else {
            &self.items[start..end]
        }
    }

    /// Keeps only the elements for which `keep` returns `true`. Removing
    /// elements cannot break the order, so no re-sort is needed.
    pub fn retain<F: FnMut(&T) -> bool>(&mut self, keep: F) {
        self.items.retain(keep);
    }

    /// Moves every element of `other` into `self`, keeping the order.
    ///
    /// Appending is `O(n + m)`: both sides are already sorted, so a stable
    /// sort of the concatenation detects the two runs and merges them.
    pub fn absorb(&mut self, other: SortedVec<T>) {
        if other.is_empty() {
            return;
        }
        let needs_sort = match (self.items.last(), other.items.first()) {
            (Some(a), Some(b)) => a > b,
            _ => false,
        };
        self.items.extend(other.items);
        if needs_sort {
            self.items.sort();
        }
    }
}

impl<T: Ord> FromIterator<T> for SortedVec<T> {
    fn from_iter<I: IntoIterator<Item = T>>(iter: I) -> Self {
        SortedVec::from_unsorted(iter.into_iter().collect())
    }
}

impl<T: Ord> Extend<T> for SortedVec<T> {
    fn extend<I: IntoIterator<Item = T>>(&mut self, iter: I) {
        let before = self.items.len();
        self.items.extend(iter);
        if !crate::check::is_sorted(&self.items[before.saturating_sub(1)..]) {
            self.items.sort();
        }
    }
}

impl<T> IntoIterator for SortedVec<T> {
    type Item = T;
    type IntoIter = std::vec::IntoIter<T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.into_iter()
    }
}

impl<'a, T> IntoIterator for &'a SortedVec<T> {
    type Item = &'a T;
    type IntoIter = std::slice::Iter<'a, T>;

    fn into_iter(self) -> Self::IntoIter {
        self.items.iter()
    }
}

impl<T: fmt::Debug> fmt::Debug for SortedVec<T> {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        f.debug_set().entries(self.items.iter()).finish()
    }
}

impl<T: fmt::Display> fmt::Display for SortedVec<T> {
    /// Formats as `[1, 2, 3]`.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "[")?;
        for (i, x) in self.items.iter().enumerate() {
            if i > 0 {
                write!(f, ", ")?;
            }
            write!(f, "{x}")?;
        }
        write!(f, "]")
    }
}

/// Merges many sorted sources into one sorted stream.
///
/// Keeps the head of each source in a min-heap, so producing each element
/// costs `O(log k)` for `k` sources. Equal elements come out in source
/// order (source 0 first), which makes the merge stable.
///
/// ```
/// use sorted_slices::KWayMerge;
/// let a = [1, 4, 7];
/// let b = [2, 4, 8];
/// let c = [0, 9];
/// let all: Vec<i32> = KWayMerge::new(vec![&a[..], &b[..], &c[..]]).copied().collect();
/// assert_eq!(all, vec![0, 1, 2, 4, 4, 7, 8, 9]);
/// ```
pub struct KWayMerge<'a, T> {
    sources: Vec<&'a [T]>,
    heap: BinaryHeap<Reverse<HeapEntry<'a, T>>>,
    remaining: usize,
}

/// One heap entry: the current head of a source, its source index and the
/// position of the head within the source.
struct HeapEntry<'a, T> {
    value: &'a T,
    source: usize,
    pos: usize,
}

impl<T: Ord> PartialEq for HeapEntry<'_, T> {
    fn eq(&self, other: &Self) -> bool {
        self.cmp(other) == Ordering::Equal
    }
}

impl<T: Ord> Eq for HeapEntry<'_, T> {}

impl<T: Ord> PartialOrd for HeapEntry<'_, T> {
    fn partial_cmp(&self, other: &Self) -> Option<Ordering> {
        Some(self.cmp(other))
    }
}

impl<T: Ord> Ord for HeapEntry<'_, T> {
    fn cmp(&self, other: &Self) -> Ordering {
        // Break ties on the source index to keep the merge stable.
        self.value.cmp(other.value).then(self.source.cmp(&other.source))
    }
}

impl<'a, T: Ord> KWayMerge<'a, T> {
    /// A merge of `sources`, each of which must be sorted.
    pub fn new(sources: Vec<&'a [T]>) -> Self {
        let mut heap = BinaryHeap::with_capacity(sources.len());
        let mut remaining = 0;
        for (source, s) in sources.iter().enumerate() {
            remaining += s.len();
            if let Some(value) = s.first() {
                heap.push(Reverse(HeapEntry { value, source, pos: 0 }));
            }
        }
        KWayMerge { sources, heap, remaining }
    }
}

impl<'a, T: Ord> Iterator for KWayMerge<'a, T> {
    type Item = &'a T;

    fn next(&mut self) -> Option<Self::Item> {
        let Reverse(top) = self.heap.pop()?;
        let next_pos = top.pos + 1;
        if let Some(value) = self.sources[top.source].get(next_pos) {
            self.heap.push(Reverse(HeapEntry { value, source: top.source, pos: next_pos }));
        }
        self.remaining -= 1;
        Some(top.value)
    }

    fn size_hint(&self) -> (usize, Option<usize>) {
        (self.remaining, Some(self.remaining))
    }
}

impl<T: Ord> ExactSizeIterator for KWayMerge<'_, T> {}

impl<T: Ord> FusedIterator for KWayMerge<'_, T> {}

/// Order statistics on sorted data.
pub mod stats {
    /// Median of a sorted slice; the mean of the two middle elements for an
    /// even length. Returns `None` for an empty slice.
    ///
    /// Computed in `i64` so two large `i32` values cannot overflow.
    ///
    /// ```
    /// use sorted_slices::stats::median;
    /// assert_eq!(median(&[1, 3, 8]), Some(3.0));
    /// assert_eq!(median(&[1, 2, 3, 4]), Some(2.5));
    /// ```
    pub fn median(xs: &[i32]) -> Option<f64> {
        let n = xs.len();
        if n == 0 {
            return None;
        }
        if n % 2 == 1 {
            Some(f64::from(xs[n / 2]))
        } else {
            let sum = i64::from(xs[n / 2 - 1]) + i64::from(xs[n / 2]);
            Some(sum as f64 / 2.0)
        }
    }

    /// The `q`-quantile (`0.0 ..= 1.0`) of a sorted slice with linear
    /// interpolation between closest ranks, as NumPy's default method.
    ///
    /// # Panics
    ///
    /// Panics if `q` is outside `0.0 ..= 1.0` or is NaN.
    pub fn quantile(xs: &[i32], q: f64) -> Option<f64> {
        assert!((0.0..=1.0).contains(&q), "quantile {q} outside [0, 1]");
        if xs.is_empty() {
            return None;
        }
        let h = q * (xs.len() - 1) as f64;
        let lo = h.floor() as usize;
        let hi = h.ceil() as usize;
        let frac = h - lo as f64;
        let a = f64::from(xs[lo]);
        let b = f64::from(xs[hi]);
        Some(a + (b - a) * frac)
    }

    /// Number of elements in the closed interval `[lo, hi]`.
    pub fn count_between(xs: &[i32], lo: i32, hi: i32) -> usize {
        if lo > hi {
            return 0;
        }
        let start = crate::search::lower_bound(xs, &lo);
        let end = crate::search::upper_bound(xs, &hi);
        end.saturating_sub(start)
    }

    /// Rank of `x`: the number of elements strictly less than `x`.
    pub fn rank(xs: &[i32], x: i32) -> usize {
        crate::search::lower_bound(xs, &x)
    }

    /// Largest gap between neighbours, with the index of its left element.
    /// Returns `None` when there are fewer than two elements.
    pub fn largest_gap(xs: &[i32]) -> Option<(usize, u32)> {
        xs.windows(2)
            .enumerate()
            .map(|(i, w)| (i, w[1].abs_diff(w[0])))
            .max_by(|x, y| x.1.cmp(&y.1).then(y.0.cmp(&x.0)))
    }
}

/// Half-open integer intervals `[start, end)`.
pub mod intervals {
    /// A half-open interval of `i32` values. Empty when `start >= end`.
    #[derive(Debug, Clone, Copy, PartialEq, Eq, PartialOrd, Ord, Hash)]
    pub struct Interval {
        /// First value inside the interval.
        pub start: i32,
        /// First value after the interval.
        pub end: i32,
    }

    impl Interval {
        /// A new interval; does not check `start <= end`.
        pub const fn new(start: i32, end: i32) -> Self {
            Interval { start, end }
        }

        /// Number of values inside the interval (0 when empty).
        pub fn len(&self) -> u32 {
            if self.end > self.start {
                self.end.abs_diff(self.start)
            } else {
                0
            }
        }

        /// Returns `true` if the interval holds no value.
        pub fn is_empty(&self) -> bool {
            self.start >= self.end
        }

        /// Returns `true` if `x` lies inside the interval.
        pub fn contains(&self, x: i32) -> bool {
            self.start <= x && x < self.end
        }

        /// Returns `true` if the two intervals share a value or touch.
        pub fn touches(&self, other: &Interval) -> bool {
            self.start <= other.end && other.start <= self.end
        }
    }

    /// Coalesces overlapping or touching intervals.
    ///
    /// The input may be in any order; the output is sorted by `start`,
    /// disjoint, non-touching and free of empty intervals.
    ///
    /// ```
    /// use sorted_slices::intervals::{coalesce, Interval};
    /// let v = vec![Interval::new(5, 8), Interval::new(1, 3), Interval::new(2, 5)];
    /// assert_eq!(coalesce(v), vec![Interval::new(1, 8)]);
    /// ```
    pub fn coalesce(mut v: Vec<Interval>) -> Vec<Interval> {
        v.retain(|iv| !iv.is_empty());
        v.sort_unstable();
        let mut out: Vec<Interval> = Vec::with_capacity(v.len());
        for iv in v {
            match out.last_mut() {
                Some(last) if last.touches(&iv) => last.end = last.end.max(iv.end),
                _ => out.push(iv),
            }
        }
        out
    }

    /// Index of the interval containing `x` in a coalesced list, if any.
    pub fn find(coalesced: &[Interval], x: i32) -> Option<usize> {
        // The first interval whose end is beyond `x` is the only candidate.
        let i = crate::search::partition_point(coalesced, |iv| iv.end <= x);
        coalesced.get(i).filter(|iv| iv.contains(x)).map(|_| i)
    }

    /// Total number of values covered by a coalesced list.
    pub fn covered(coalesced: &[Interval]) -> u64 {
        coalesced.iter().map(|iv| u64::from(iv.len())).sum()
    }
}

/// Sorts `xs` if it is not sorted yet and reports whether it had to.
///
/// Checking first costs one linear pass, which is cheap next to the sort
/// and lets callers count how often their input arrives unsorted.
pub fn ensure_sorted(xs: &mut [i32]) -> bool {
    if check::is_sorted(xs) {
        false
    } else {
        xs.sort_unstable();
        true
    }
}

/// Error returned by the checked entry points when an input is unsorted.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct NotSorted {
    /// Which argument was unsorted (`"a"` or `"b"`).
    pub argument: &'static str,
    /// Index of the first element smaller than its predecessor.
    pub index: usize,
}

impl fmt::Display for NotSorted {
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "argument `{}` is not sorted at index {}", self.argument, self.index)
    }
}

impl std::error::Error for NotSorted {}

/// Checks that both arguments of a two-slice operation are sorted.
///
/// # Errors
///
/// Returns [`NotSorted`] naming the first offending argument.
pub fn check_pair(a: &[i32], b: &[i32]) -> Result<(), NotSorted> {
    if let Some(index) = check::first_unsorted(a) {
        return Err(NotSorted { argument: "a", index });
    }
    if let Some(index) = check::first_unsorted(b) {
        return Err(NotSorted { argument: "b", index });
    }
    Ok(())
}

/// Multiset intersection that validates its inputs first.
///
/// # Errors
///
/// Returns [`NotSorted`] if either slice is unsorted.
pub fn checked_intersection(a: &[i32], b: &[i32]) -> Result<Vec<i32>, NotSorted> {
    check_pair(a, b)?;
    Ok(set_ops::intersection(a, b))
}

#[cfg(test)]
mod tests {
    use super::intervals::{coalesce, find, Interval};
    use super::runs::{expand_runs, mode, run_lengths, Runs};
    use super::search::*;
    use super::set_ops::*;
    use super::stats::{count_between, median, quantile};
    use super::*;

    /// A tiny xorshift generator so the randomized tests need no crates and
    /// are reproducible from the seed in the failure message.
    struct XorShift(u64);

    impl XorShift {
        fn next(&mut self) -> u64 {
            let mut x = self.0;
            x ^= x << 13;
            x ^= x >> 7;
            x ^= x << 17;
            self.0 = x;
            x
        }

        /// A sorted vector of `n` values in `0..range`, duplicates likely.
        fn sorted_vec(&mut self, n: usize, range: i32) -> Vec<i32> {
            let mut v: Vec<i32> = (0..n).map(|_| (self.next() % range as u64) as i32).collect();
            v.sort_unstable();
            v
        }
    }

    /// Counts of each value, the reference for the multiset operations.
    fn counts(xs: &[i32]) -> std::collections::BTreeMap<i32, usize> {
        let mut m = std::collections::BTreeMap::new();
        for &x in xs {
            *m.entry(x).or_insert(0) += 1;
        }
        m
    }

    #[test]
    fn bounds_on_small_slices() {
        let xs = [1, 2, 2, 2, 5, 8];
        assert_eq!(lower_bound(&xs, &0), 0);
        assert_eq!(lower_bound(&xs, &2), 1);
        assert_eq!(upper_bound(&xs, &2), 4);
        assert_eq!(lower_bound(&xs, &6), 5);
        assert_eq!(upper_bound(&xs, &8), 6);
        assert_eq!(equal_range(&xs, &2), 1..4);
        assert_eq!(count(&xs, &2), 3);
        assert!(contains(&xs, &5));
        assert!(!contains(&xs, &4));
        let empty: [i32; 0] = [];
        assert_eq!(lower_bound(&empty, &3), 0);
        assert_eq!(upper_bound(&empty, &3), 0);
    }

    #[test]
    fn galloping_matches_binary_search() {
        let mut rng = XorShift(0x9E37_79B9_7F4A_7C15);
        for _ in 0..200 {
            let xs = rng.sorted_vec(300, 100);
            let x = (rng.next() % 110) as i32;
            let lb = lower_bound(&xs, &x);
            let ub = upper_bound(&xs, &x);
            for start in [0, lb / 2, lb] {
                assert_eq!(gallop_lower_bound(&xs, &x, start), lb, "x={x} start={start}");
            }
            assert_eq!(gallop_upper_bound(&xs, &x, lb), ub, "x={x}");
        }
    }

    #[test]
    fn nearest_prefers_smaller_on_ties() {
        assert_eq!(nearest(&[10, 20], 15), Some(0));
        assert_eq!(nearest(&[10, 20], 16), Some(1));
        assert_eq!(nearest(&[10], -5), Some(0));
        assert_eq!(nearest(&[i64::MIN, i64::MAX], 0), Some(1));
    }

    #[test]
    fn multiset_operations_match_counts() {
        let mut rng = XorShift(42);
        for _ in 0..100 {
            let a = rng.sorted_vec(50, 20);
            let b = rng.sorted_vec(70, 20);
            let (ca, cb) = (counts(&a), counts(&b));
            let inter = counts(&intersection(&a, &b));
            let uni = counts(&union(&a, &b));
            let diff = counts(&difference(&a, &b));
            for v in 0..20 {
                let m = ca.get(&v).copied().unwrap_or(0);
                let n = cb.get(&v).copied().unwrap_or(0);
                assert_eq!(inter.get(&v).copied().unwrap_or(0), m.min(n));
                assert_eq!(uni.get(&v).copied().unwrap_or(0), m.max(n));
                assert_eq!(diff.get(&v).copied().unwrap_or(0), m - m.min(n));
            }
            assert!(check::is_sorted(&union(&a, &b)));
            assert_eq!(intersection_galloping(&a, &b), intersection(&a, &b));
        }
    }

    #[test]
    fn set_operations_are_strictly_increasing() {
        let a = [1, 1, 2, 4, 4, 4, 9];
        let b = [1, 4, 4, 5, 9, 9];
        assert_eq!(union_dedup(&a, &b), vec![1, 2, 4, 5, 9]);
        assert_eq!(intersection_dedup(&a, &b), vec![1, 4, 9]);
        assert!(check::is_strictly_sorted(&union_dedup(&a, &b)));
    }

    #[test]
    fn subset_and_disjoint() {
        assert!(is_subset(&[2, 2], &[1, 2, 2, 3]));
        assert!(!is_subset(&[2, 2, 2], &[1, 2, 2, 3]));
        assert!(is_subset(&[], &[1]));
        assert!(is_disjoint(&[1, 3, 5], &[2, 4, 6]));
        assert!(!is_disjoint(&[1, 3, 5], &[5]));
    }

    #[test]
    fn runs_round_trip() {
        let xs = [3, 3, 3, 4, 7, 7];
        let r = run_lengths(&xs);
        assert_eq!(r, vec![(3, 3), (4, 1), (7, 2)]);
        assert_eq!(expand_runs(&r), xs.to_vec());
        assert_eq!(mode(&xs), Some((3, 3)));
        assert_eq!(mode(&[]), None);
        assert_eq!(Runs::new(&xs).count(), 3);
    }

    #[test]
    fn sorted_vec_keeps_order() {
        let mut v = SortedVec::new();
        for x in [5, 1, 4, 1, 5, 9, 2, 6] {
            v.insert(x);
        }
        assert_eq!(v.as_slice(), &[1, 1, 2, 4, 5, 5, 6, 9]);
        assert_eq!(v.insert_unique(4), Err(3));
        assert_eq!(v.insert_unique(3), Ok(3));
        assert_eq!(v.remove_all(&5), 2);
        assert_eq!(v.remove_one(&1), Some(1));
        assert_eq!(v.count(&1), 1);
        assert_eq!(v.range(2..=4), &[2, 3, 4]);
        assert_eq!(v.to_string(), "[1, 2, 3, 4, 6, 9]");
        assert!(SortedVec::from_sorted(vec![2, 1]).is_err());
    }

    #[test]
    fn sorted_vec_absorb_and_extend() {
        let mut a: SortedVec<i32> = [1, 5, 9].into_iter().collect();
        let b: SortedVec<i32> = [2, 5, 10].into_iter().collect();
        a.absorb(b);
        assert_eq!(a.as_slice(), &[1, 2, 5, 5, 9, 10]);
        a.extend([11, 12]);
        a.extend([0]);
        assert!(check::is_sorted(a.as_slice()));
        assert_eq!(a.first(), Some(&0));
        assert_eq!(a.last(), Some(&12));
    }

    #[test]
    fn k_way_merge_is_stable_and_sorted() {
        let mut rng = XorShift(7);
        let sources: Vec<Vec<i32>> = (0..5).map(|_| rng.sorted_vec(40, 30)).collect();
        let slices: Vec<&[i32]> = sources.iter().map(|s| s.as_slice()).collect();
        let merged: Vec<i32> = KWayMerge::new(slices).copied().collect();
        let mut expected: Vec<i32> = sources.concat();
        expected.sort();
        assert_eq!(merged, expected);
        assert_eq!(KWayMerge::<i32>::new(vec![]).len(), 0);
    }

    #[test]
    fn statistics() {
        assert_eq!(median(&[]), None);
        assert_eq!(median(&[i32::MAX, i32::MAX]), Some(i32::MAX as f64));
        assert_eq!(quantile(&[0, 10], 0.25), Some(2.5));
        assert_eq!(quantile(&[4], 0.9), Some(4.0));
        assert_eq!(count_between(&[1, 2, 3, 4, 5], 2, 4), 3);
        assert_eq!(count_between(&[1, 2, 3], 3, 2), 0);
    }

    #[test]
    fn interval_coalescing() {
        let v = vec![Interval::new(10, 12), Interval::new(1, 3), Interval::new(3, 4), Interval::new(6, 6)];
        let c = coalesce(v);
        assert_eq!(c, vec![Interval::new(1, 4), Interval::new(10, 12)]);
        assert_eq!(find(&c, 3), Some(0));
        assert_eq!(find(&c, 4), None);
        assert_eq!(find(&c, 11), Some(1));
        assert_eq!(intervals::covered(&c), 5);
    }

    #[test]
    fn checked_entry_points_name_the_argument() {
        let err = checked_intersection(&[1, 2], &[3, 1]).unwrap_err();
        assert_eq!(err, NotSorted { argument: "b", index: 1 });
        assert_eq!(err.to_string(), "argument `b` is not sorted at index 1");
        assert_eq!(checked_intersection(&[1, 2, 2], &[2, 2]), Ok(vec![2, 2]));
    }

    #[test]
    fn ensure_sorted_reports_work() {
        let mut xs = [3, 1, 2];
        assert!(ensure_sorted(&mut xs));
        assert!(!ensure_sorted(&mut xs));
        assert_eq!(xs, [1, 2, 3]);
    }
}
