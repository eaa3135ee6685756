//! A small seeded generator (xoshiro256**), passed explicitly wherever randomness is needed
//! so that no global random state exists and runs are reproducible.

use crate::{Error, Result};

/// Seeded pseudo-random generator for initialisation and dropout.
#[derive(Debug, Clone, PartialEq, Eq)]
pub struct Generator {
    state: [u64; 4],
}

impl Generator {
    /// A generator whose whole stream is determined by `seed`.
    pub fn new(seed: u64) -> Self {
        // SplitMix64 spreads any seed (even 0) over the 256-bit state, as xoshiro's authors advise.
        let mut z = seed;
        let mut next = || {
            z = z.wrapping_add(0x9E37_79B9_7F4A_7C15);
            let mut x = z;
            x = (x ^ (x >> 30)).wrapping_mul(0xBF58_476D_1CE4_E5B9);
            x = (x ^ (x >> 27)).wrapping_mul(0x94D0_49BB_1331_11EB);
            x ^ (x >> 31)
        };
        Generator {
            state: [next(), next(), next(), next()],
        }
    }

    /// Number of words in [`state`](Self::state).
    pub const STATE_WORDS: usize = 4;

    /// The whole internal state, [`STATE_WORDS`](Self::STATE_WORDS) words: a generator
    /// rebuilt from it by [`from_state`](Self::from_state) continues with exactly the
    /// same draws (no sample is cached between calls, not even Box–Muller's second one).
    pub fn state(&self) -> Vec<u64> {
        self.state.to_vec()
    }

    /// The generator whose internal state is `words`, as returned by
    /// [`state`](Self::state). Another number of words, or all zeros (a state xoshiro
    /// never leaves, so it could not come from `state`), is [`Error::InvalidArgument`].
    pub fn from_state(words: &[u64]) -> Result<Self> {
        const OP: &str = "Generator::from_state";
        let state: [u64; Self::STATE_WORDS] = words.try_into().map_err(|_| {
            Error::invalid(
                OP,
                format!(
                    "expected {} state words, got {}",
                    Self::STATE_WORDS,
                    words.len()
                ),
            )
        })?;
        if state == [0; Self::STATE_WORDS] {
            return Err(Error::invalid(
                OP,
                "an all-zero state would draw only zeros; use the words Generator::state returned",
            ));
        }
        Ok(Generator { state })
    }

    /// Next 64 random bits.
    pub fn next_u64(&mut self) -> u64 {
        let s = &mut self.state;
        let result = s[1].wrapping_mul(5).rotate_left(7).wrapping_mul(9);
        let t = s[1] << 17;
        s[2] ^= s[0];
        s[3] ^= s[1];
        s[1] ^= s[2];
        s[0] ^= s[3];
        s[2] ^= t;
        s[3] = s[3].rotate_left(45);
        result
    }

    /// Uniform in `[0, 1)` with 53 random bits.
    pub fn uniform(&mut self) -> f64 {
        (self.next_u64() >> 11) as f64 * (1.0 / (1u64 << 53) as f64)
    }

    /// Standard normal sample (Box–Muller).
    pub fn normal(&mut self) -> f64 {
        // 1 - uniform() lies in (0, 1], so the logarithm is finite.
        let radius = (-2.0 * (1.0 - self.uniform()).ln()).sqrt();
        radius * (std::f64::consts::TAU * self.uniform()).cos()
    }
}
