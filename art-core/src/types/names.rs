//! The one rule for the names clients choose (projects, models, splits): they become directory
//! names on the backend's machine and parts of model ids, so they must be safe as both.

/// A name that breaks the rule: says which name and what the rule is.
#[derive(Debug, Clone, PartialEq, Eq, thiserror::Error)]
#[error(
    "`{value}` is not a valid {what}: use 1 to {MAX_NAME_LEN} letters, digits, '-', '_' or '.', \
     not starting with '.'"
)]
pub struct InvalidName {
    /// What the name is for ("project", "name", "split").
    pub what: &'static str,
    pub value: String,
}

/// The longest name allowed.
pub const MAX_NAME_LEN: usize = 128;

/// Checks `value`, the `what` of something: 1 to 128 ASCII letters, digits, `-`, `_` or `.`, not
/// starting with `.` (no hidden files, no `..`, no path separators, nothing a shell or URL needs
/// to quote).
pub fn check_name(what: &'static str, value: &str) -> Result<(), InvalidName> {
    let ok = !value.is_empty()
        && value.len() <= MAX_NAME_LEN
        && !value.starts_with('.')
        && value
            .chars()
            .all(|c| c.is_ascii_alphanumeric() || "-_.".contains(c));
    if ok {
        Ok(())
    } else {
        Err(InvalidName {
            what,
            value: value.to_string(),
        })
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn names_safe_as_directories_and_ids_pass() {
        for good in ["agent-001", "Qwen2.5_run", "val", "a"] {
            assert_eq!(check_name("name", good), Ok(()));
        }
        let longest = "x".repeat(MAX_NAME_LEN);
        assert!(check_name("name", &longest).is_ok());
        for bad in ["", ".hidden", "..", "a/b", "a\\b", "has space", "é", "a\0b"] {
            assert!(check_name("name", bad).is_err(), "{bad:?}");
        }
        assert!(check_name("name", &format!("{longest}x")).is_err());
        let message = check_name("split", "a/b").unwrap_err().to_string();
        assert_eq!(
            message,
            "`a/b` is not a valid split: use 1 to 128 letters, digits, '-', '_' or '.', \
             not starting with '.'"
        );
    }
}
