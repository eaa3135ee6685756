//! Byte counts as people write them: `80GiB`, `1.5 TB`, `512MiB`, `1000000`.

use crate::Error;
use std::fmt;
use std::str::FromStr;

/// A number of bytes that parses from and prints with binary or decimal units.
#[derive(Clone, Copy, Debug, PartialEq, Eq, PartialOrd, Ord)]
pub struct Bytes(pub usize);

const UNITS: [(&str, f64); 9] = [
    ("TiB", 1024.0 * 1024.0 * 1024.0 * 1024.0),
    ("GiB", 1024.0 * 1024.0 * 1024.0),
    ("MiB", 1024.0 * 1024.0),
    ("KiB", 1024.0),
    ("TB", 1e12),
    ("GB", 1e9),
    ("MB", 1e6),
    ("KB", 1e3),
    ("B", 1.0),
];

impl FromStr for Bytes {
    type Err = Error;

    fn from_str(text: &str) -> Result<Bytes, Error> {
        let trimmed = text.trim();
        let (number, scale) = UNITS
            .iter()
            .find_map(|&(unit, scale)| {
                let lower = trimmed.to_ascii_lowercase();
                lower
                    .strip_suffix(&unit.to_ascii_lowercase())
                    .map(|n| (trimmed[..n.len()].trim().to_string(), scale))
            })
            .unwrap_or_else(|| (trimmed.to_string(), 1.0));
        let invalid = || {
            Error::Invalid(format!(
                "{text:?} is not a byte count: write a number with an optional unit, e.g. \
                 80GiB, 1.5TB, 512MiB or 1000000"
            ))
        };
        let value: f64 = number.parse().map_err(|_| invalid())?;
        let bytes = value * scale;
        if !bytes.is_finite() || bytes < 0.0 || bytes > usize::MAX as f64 {
            return Err(invalid());
        }
        Ok(Bytes(bytes.round() as usize))
    }
}

impl fmt::Display for Bytes {
    /// Binary units with two decimals (`74.51 GiB`), plain bytes under 1 KiB.
    fn fmt(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        let value = self.0 as f64;
        match UNITS[..4].iter().find(|&&(_, scale)| value >= scale) {
            Some((unit, scale)) => write!(f, "{:.2} {unit}", value / scale),
            None => write!(f, "{} B", self.0),
        }
    }
}
