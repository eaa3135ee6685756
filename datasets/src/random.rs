//! NumPy's legacy `RandomState`, as far as Megatron's datasets use it: seeded with an
//! integer, and `shuffle` of a one-dimensional array. Megatron draws every permutation of
//! its GPT dataset from `RandomState(seed)`, so matching its draws bit for bit gives the
//! same samples in the same order.

/// A Mersenne Twister (MT19937) seeded as `numpy.random.RandomState(seed)` seeds it.
pub struct RandomState {
    state: [u32; 624],
    next: usize,
}

impl RandomState {
    /// `RandomState(seed)` for an integer seed: the reference `init_genrand`.
    pub fn new(seed: u32) -> RandomState {
        let mut state = [0u32; 624];
        state[0] = seed;
        for i in 1..624 {
            let previous = state[i - 1];
            state[i] = 1_812_433_253u32
                .wrapping_mul(previous ^ (previous >> 30))
                .wrapping_add(i as u32);
        }
        RandomState { state, next: 624 }
    }

    fn twist(&mut self) {
        const UPPER: u32 = 0x8000_0000;
        const LOWER: u32 = 0x7fff_ffff;
        for i in 0..624 {
            let y = (self.state[i] & UPPER) | (self.state[(i + 1) % 624] & LOWER);
            let mut value = self.state[(i + 397) % 624] ^ (y >> 1);
            if y & 1 == 1 {
                value ^= 0x9908_b0df;
            }
            self.state[i] = value;
        }
        self.next = 0;
    }

    /// The next 32-bit output.
    pub fn next_u32(&mut self) -> u32 {
        if self.next == 624 {
            self.twist();
        }
        let mut y = self.state[self.next];
        self.next += 1;
        y ^= y >> 11;
        y ^= (y << 7) & 0x9d2c_5680;
        y ^= (y << 15) & 0xefc6_0000;
        y ^ (y >> 18)
    }

    /// Two outputs, the first as the high half.
    pub fn next_u64(&mut self) -> u64 {
        let high = u64::from(self.next_u32());
        (high << 32) | u64::from(self.next_u32())
    }

    /// A uniform integer in `[0, max]` by masked rejection, as NumPy draws the index of
    /// each swap of a shuffle.
    pub fn interval(&mut self, max: u64) -> u64 {
        if max == 0 {
            return 0;
        }
        let mask = u64::MAX >> max.leading_zeros();
        loop {
            let value = match max <= u64::from(u32::MAX) {
                true => u64::from(self.next_u32()) & mask,
                false => self.next_u64() & mask,
            };
            if value <= max {
                return value;
            }
        }
    }

    /// `RandomState.shuffle` of a one-dimensional array: Fisher–Yates from the top.
    pub fn shuffle<T>(&mut self, items: &mut [T]) {
        for i in (1..items.len()).rev() {
            let j = self.interval(i as u64) as usize;
            items.swap(i, j);
        }
    }
}
