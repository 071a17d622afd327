//! OptimalPLR (Xie et al., VLDB J. 2014, as used by the PGM-index and ROLEX
//! §3.2): the fewest line segments such that every point is within ε of its
//! segment, in O(N), by maintaining the convex hulls of the upper (y + ε)
//! and lower (y − ε) points and the tightest enclosing parallelogram.
//!
//! Arithmetic is exact (i128) while segmenting; the final line is computed
//! in f64, and callers measure the line's real maximum error over the points
//! ([`max_error`]) rather than trusting ε, so float rounding can never make
//! a prediction range too narrow.

#[derive(Debug, Clone, Copy, PartialEq, Eq)]
struct P {
    x: i128,
    y: i128,
}

/// The direction from one point to another, compared by cross products.
#[derive(Debug, Clone, Copy)]
struct Slope {
    dx: i128,
    dy: i128,
}

fn sub(a: P, b: P) -> Slope {
    Slope {
        dx: a.x - b.x,
        dy: a.y - b.y,
    }
}

impl Slope {
    fn lt(self, o: Slope) -> bool {
        self.dy * o.dx < self.dx * o.dy
    }
    fn gt(self, o: Slope) -> bool {
        self.dy * o.dx > self.dx * o.dy
    }
    fn same(self, o: Slope) -> bool {
        self.dy * o.dx == self.dx * o.dy
    }
    fn as_f64(self) -> f64 {
        self.dy as f64 / self.dx as f64
    }
}

fn cross(o: P, a: P, b: P) -> i128 {
    let oa = sub(a, o);
    let ob = sub(b, o);
    oa.dx * ob.dy - oa.dy * ob.dx
}

/// One growing segment.
#[derive(Debug, Clone)]
pub struct OptimalPlr {
    eps: i128,
    lower: Vec<P>,
    upper: Vec<P>,
    lower_start: usize,
    upper_start: usize,
    points: usize,
    rect: [P; 4],
    first_x: u64,
    last_x: u64,
}

/// A fitted line: `y = intercept + slope * (x - origin)`.
#[derive(Debug, Clone, Copy, PartialEq)]
pub struct Line {
    pub origin: u64,
    pub slope: f64,
    pub intercept: f64,
}

impl Line {
    pub fn eval(&self, x: u64) -> f64 {
        self.intercept + self.slope * (x.saturating_sub(self.origin) as f64)
    }
}

impl OptimalPlr {
    pub fn new(eps: u64) -> OptimalPlr {
        let z = P { x: 0, y: 0 };
        OptimalPlr {
            eps: eps as i128,
            lower: Vec::new(),
            upper: Vec::new(),
            lower_start: 0,
            upper_start: 0,
            points: 0,
            rect: [z; 4],
            first_x: 0,
            last_x: 0,
        }
    }

    pub fn points(&self) -> usize {
        self.points
    }

    /// Adds a point with `x` above every earlier one. Returns false, leaving
    /// the segment unchanged, if no line within ε of all points exists.
    pub fn add(&mut self, x: u64, y: i64) -> bool {
        assert!(
            self.points == 0 || x > self.last_x,
            "points must have increasing x"
        );
        let p1 = P {
            x: x as i128,
            y: y as i128 + self.eps,
        };
        let p2 = P {
            x: x as i128,
            y: y as i128 - self.eps,
        };
        if self.points == 0 {
            self.first_x = x;
            self.last_x = x;
            self.rect[0] = p1;
            self.rect[1] = p2;
            self.upper.clear();
            self.lower.clear();
            self.upper.push(p1);
            self.lower.push(p2);
            self.upper_start = 0;
            self.lower_start = 0;
            self.points = 1;
            return true;
        }
        if self.points == 1 {
            self.rect[2] = p2;
            self.rect[3] = p1;
            self.upper.push(p1);
            self.lower.push(p2);
            self.points = 2;
            self.last_x = x;
            return true;
        }
        let slope1 = sub(self.rect[2], self.rect[0]);
        let slope2 = sub(self.rect[3], self.rect[1]);
        let outside1 = sub(p1, self.rect[2]).lt(slope1);
        let outside2 = sub(p2, self.rect[3]).gt(slope2);
        if outside1 || outside2 {
            return false;
        }
        if sub(p1, self.rect[1]).lt(slope2) {
            // The new upper point tightens the largest slope.
            let mut min = sub(self.lower[self.lower_start], p1);
            let mut min_i = self.lower_start;
            for i in self.lower_start + 1..self.lower.len() {
                let val = sub(self.lower[i], p1);
                if val.gt(min) {
                    break;
                }
                min = val;
                min_i = i;
            }
            self.rect[1] = self.lower[min_i];
            self.rect[3] = p1;
            self.lower_start = min_i;
            let mut end = self.upper.len();
            while end >= self.upper_start + 2
                && cross(self.upper[end - 2], self.upper[end - 1], p1) <= 0
            {
                end -= 1;
            }
            self.upper.truncate(end);
            self.upper.push(p1);
        }
        if sub(p2, self.rect[0]).gt(slope1) {
            // The new lower point tightens the smallest slope.
            let mut max = sub(self.upper[self.upper_start], p2);
            let mut max_i = self.upper_start;
            for i in self.upper_start + 1..self.upper.len() {
                let val = sub(self.upper[i], p2);
                if val.lt(max) {
                    break;
                }
                max = val;
                max_i = i;
            }
            self.rect[0] = self.upper[max_i];
            self.rect[2] = p2;
            self.upper_start = max_i;
            let mut end = self.lower.len();
            while end >= self.lower_start + 2
                && cross(self.lower[end - 2], self.lower[end - 1], p2) >= 0
            {
                end -= 1;
            }
            self.lower.truncate(end);
            self.lower.push(p2);
        }
        self.points += 1;
        self.last_x = x;
        true
    }

    /// The line through the parallelogram's centre with the mean of its
    /// extreme slopes, relative to the segment's first x.
    pub fn line(&self) -> Line {
        let origin = self.first_x;
        if self.points <= 1 {
            let y = if self.points == 0 {
                0.0
            } else {
                ((self.rect[0].y + self.rect[1].y) / 2) as f64
            };
            return Line {
                origin,
                slope: 0.0,
                intercept: y,
            };
        }
        let [p0, p1, p2, p3] = self.rect;
        let s1 = sub(p2, p0);
        let s2 = sub(p3, p1);
        let o = origin as i128;
        let (ix, iy) = if s1.same(s2) {
            ((p0.x - o) as f64, p0.y as f64)
        } else {
            let p0p1 = sub(p1, p0);
            let a = s1.dx * s2.dy - s1.dy * s2.dx;
            let b = (p0p1.dx * s2.dy - p0p1.dy * s2.dx) as f64 / a as f64;
            (
                (p0.x - o) as f64 + b * s1.dx as f64,
                p0.y as f64 + b * s1.dy as f64,
            )
        };
        let slope = (s1.as_f64() + s2.as_f64()) / 2.0;
        Line {
            origin,
            slope,
            intercept: iy - ix * slope,
        }
    }
}

/// The error bound to store for `line` over `points`: strictly above the
/// largest |line(x) − y| computed exactly as clients compute predictions.
pub fn max_error(line: &Line, points: impl Iterator<Item = (u64, i64)>) -> u32 {
    let mut worst = 0.0f64;
    for (x, y) in points {
        let d = (line.eval(x) - y as f64).abs();
        if d.is_nan() {
            return u32::MAX;
        }
        worst = worst.max(d);
    }
    (worst.floor() as u64 + 1).min(u32::MAX as u64) as u32
}

/// Greedy segmentation of strictly increasing `(x, index)` points with at
/// most `eps` error: the ranges of points in each segment.
pub fn segment_keys(keys: &[u64], eps: u64) -> Vec<(usize, usize, Line)> {
    let mut out = Vec::new();
    let mut start = 0;
    let mut plr = OptimalPlr::new(eps);
    for (i, &k) in keys.iter().enumerate() {
        if !plr.add(k, (i - start) as i64) {
            out.push((start, i, plr.line()));
            start = i;
            plr = OptimalPlr::new(eps);
            assert!(plr.add(k, 0), "a first point always fits");
        }
    }
    if start < keys.len() {
        out.push((start, keys.len(), plr.line()));
    }
    out
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;

    proptest! {
        // Every point of every segment is within ε (+1 for float rounding)
        // of its line, and segments tile the input.
        #[test]
        fn segments_respect_epsilon(mut keys in prop::collection::vec(any::<u64>(), 1..2000), eps in 1u64..64) {
            keys.sort_unstable();
            keys.dedup();
            let segs = segment_keys(&keys, eps);
            let mut next = 0;
            for (s, e, line) in &segs {
                prop_assert_eq!(*s, next);
                next = *e;
                let err = max_error(line, (*s..*e).map(|i| (keys[i], (i - s) as i64)));
                prop_assert!(err as u64 <= eps + 1, "err {} eps {}", err, eps);
            }
            prop_assert_eq!(next, keys.len());
        }
    }

    #[test]
    fn a_line_is_one_segment() {
        let keys: Vec<u64> = (0..10_000u64).map(|i| 1000 + i * 77).collect();
        let segs = segment_keys(&keys, 4);
        assert_eq!(segs.len(), 1);
        assert!((segs[0].2.slope - 1.0 / 77.0).abs() < 1e-9);
    }

    #[test]
    fn a_refused_point_leaves_the_segment_unchanged() {
        let mut p = OptimalPlr::new(1);
        for i in 0..10u64 {
            assert!(p.add(i * 10, i as i64));
        }
        let before = p.line();
        assert!(!p.add(101, 100));
        assert_eq!(p.line(), before);
        assert_eq!(p.points(), 10);
    }
}
