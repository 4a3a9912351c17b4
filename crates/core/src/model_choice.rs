//! Which model the upstream is asked for: the route's, else the worker's
//! (`--model`); a payload's `model` only when the operator's allow-list names it. A tenant
//! does not pick what runs on the operator's API key.
//!
//! The worker screens each payload before its call ([`AllowedModels::screen`]): a `model`
//! that the list does not name is removed, so the backend sends its own (a route's
//! `model` replaces the payload's in any case).

use serde_json::{Map, Value};
use std::collections::BTreeSet;

/// The models a payload may ask for (`--allow-model`, `[worker] allow_model`); empty:
/// none, the route's or the worker's model always serves.
#[derive(Debug, Clone, Default, PartialEq, Eq)]
pub struct AllowedModels(BTreeSet<String>);

/// The longest model name accepted on the list.
pub const MAX_MODEL_NAME: usize = 256;

impl AllowedModels {
    /// A list of the given names (each checked by [`Self::parse_name`]).
    pub fn new<I: IntoIterator<Item = String>>(names: I) -> Result<Self, String> {
        names
            .into_iter()
            .map(|n| Self::parse_name(&n))
            .collect::<Result<_, _>>()
            .map(Self)
    }

    /// A model name for the list: not empty, at most [`MAX_MODEL_NAME`] bytes, no
    /// whitespace or control characters.
    pub fn parse_name(s: &str) -> Result<String, String> {
        if s.is_empty() {
            return Err("the model name is empty".into());
        }
        if s.len() > MAX_MODEL_NAME {
            return Err(format!(
                "the model name is longer than {MAX_MODEL_NAME} bytes"
            ));
        }
        if s.chars().any(|c| c.is_whitespace() || c.is_control()) {
            return Err(format!(
                "`{}`: a model name has no spaces or control characters",
                s.escape_debug()
            ));
        }
        Ok(s.to_owned())
    }

    pub fn is_empty(&self) -> bool {
        self.0.is_empty()
    }

    pub fn names(&self) -> impl Iterator<Item = &str> {
        self.0.iter().map(String::as_str)
    }

    /// Whether a payload may ask for `model`.
    pub fn allows(&self, model: &str) -> bool {
        self.0.contains(model)
    }

    /// Remove the payload's `model` unless the list names it; the removed value, if any
    /// (for the log).
    pub fn screen(&self, payload: &mut Map<String, Value>) -> Option<Value> {
        match payload.get("model") {
            None => None,
            Some(Value::String(m)) if self.allows(m) => None,
            Some(_) => payload.remove("model"),
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use proptest::prelude::*;
    use serde_json::json;

    fn list(names: &[&str]) -> AllowedModels {
        AllowedModels::new(names.iter().map(|s| s.to_string())).unwrap()
    }

    #[test]
    fn only_a_listed_model_stays_in_the_payload() {
        let allowed = list(&["premium-model-x"]);
        let mut p = json!({"prompt": "x", "model": "premium-model-x"});
        assert_eq!(allowed.screen(p.as_object_mut().unwrap()), None);
        assert_eq!(p["model"], "premium-model-x");
        for other in [json!("gpt-4o"), json!(""), json!(3), json!(null)] {
            let mut p = json!({"prompt": "x", "model": other.clone()});
            assert_eq!(allowed.screen(p.as_object_mut().unwrap()), Some(other));
            assert_eq!(p, json!({"prompt": "x"}));
        }
        // Nothing on the list: no payload picks a model.
        let mut p = json!({"prompt": "x", "model": "premium-model-x"});
        assert!(
            AllowedModels::default()
                .screen(p.as_object_mut().unwrap())
                .is_some()
        );
        assert!(p.get("model").is_none());
    }

    #[test]
    fn bad_names_are_refused_with_the_reason() {
        assert!(AllowedModels::parse_name("").unwrap_err().contains("empty"));
        assert!(
            AllowedModels::parse_name("a b")
                .unwrap_err()
                .contains("spaces")
        );
        assert!(
            AllowedModels::parse_name(&"m".repeat(300))
                .unwrap_err()
                .contains("longer")
        );
        assert_eq!(
            AllowedModels::parse_name("Qwen/Qwen2.5-1.5B").unwrap(),
            "Qwen/Qwen2.5-1.5B"
        );
    }

    proptest! {
        /// After screening, a payload's `model` is absent or on the list; every other
        /// field is untouched.
        #[test]
        fn a_screened_payload_names_only_an_allowed_model(
            names in prop::collection::vec("[a-z]{1,4}", 0..4),
            asked in prop::option::of("[a-z]{1,4}"),
        ) {
            let allowed = AllowedModels::new(names.clone()).unwrap();
            let mut p = json!({"prompt": "x"});
            if let Some(m) = &asked {
                p["model"] = json!(m);
            }
            allowed.screen(p.as_object_mut().unwrap());
            match p.get("model").and_then(Value::as_str) {
                Some(m) => prop_assert!(names.iter().any(|n| n == m)),
                None => prop_assert!(asked.is_none_or(|a| !names.contains(&a))),
            }
            prop_assert_eq!(&p["prompt"], "x");
        }
    }
}
