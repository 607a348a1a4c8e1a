//! A client's JSON parsed into structures bounded by count, not only by
//! the body's bytes: a list or a map stops at its cap instead of growing
//! with the body (72 MiB of `[0,0,...]` once became 34 times its size as
//! `serde_json::Value`s), and free-form values (an actor's or a call's
//! arguments) stay the bytes they came as ([`RawValue`], validated but
//! not built), checked for their shape only.
//!
//! The lists and maps are for `#[serde(deserialize_with = ...)]` through a
//! small function per field that names its cap and what it counts, so
//! that the refusal says which limit was passed. Pure: no I/O.

use std::collections::BTreeMap;
use std::fmt;
use std::marker::PhantomData;

use serde::Deserialize;
use serde::de::{self, Deserializer, MapAccess, SeqAccess, Visitor};
use serde_json::value::RawValue;

/// A list of at most `cap` `T`s, refused at the first one past it (what
/// follows is never parsed).
pub fn seq<'de, D, T>(d: D, cap: usize, what: &'static str) -> Result<Vec<T>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_seq(Capped::<Vec<T>> { cap, what, kind: PhantomData })
}

/// A map of at most `cap` entries, refused at the first one past it.
pub fn map<'de, D, K, V>(d: D, cap: usize, what: &'static str) -> Result<BTreeMap<K, V>, D::Error>
where
    D: Deserializer<'de>,
    K: Deserialize<'de> + Ord,
    V: Deserialize<'de>,
{
    d.deserialize_map(Capped::<BTreeMap<K, V>> { cap, what, kind: PhantomData })
}

/// [`seq`] of an optional field (`null` is None).
pub fn option_seq<'de, D, T>(d: D, cap: usize, what: &'static str) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: Deserialize<'de>,
{
    d.deserialize_option(Optional::<T> { cap, what, kind: PhantomData })
}

/// The visitor of a capped list or map (`C` is what it builds).
struct Capped<C> {
    cap: usize,
    what: &'static str,
    kind: PhantomData<C>,
}

fn too_many<E: de::Error>(cap: usize, what: &str) -> E {
    E::custom(format!("more than {cap} {what}"))
}

/// Room reserved up front: what the parser says is coming, within the cap
/// and at most 1,024 (a hint is only a hint).
fn room(hint: Option<usize>, cap: usize) -> usize {
    hint.unwrap_or(0).min(cap).min(1024)
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Capped<Vec<T>> {
    type Value = Vec<T>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "a list of at most {} {}", self.cap, self.what)
    }

    fn visit_seq<A: SeqAccess<'de>>(self, mut seq: A) -> Result<Self::Value, A::Error> {
        let mut out = Vec::with_capacity(room(seq.size_hint(), self.cap));
        while let Some(v) = seq.next_element()? {
            if out.len() == self.cap {
                return Err(too_many(self.cap, self.what));
            }
            out.push(v);
        }
        Ok(out)
    }
}

impl<'de, K: Deserialize<'de> + Ord, V: Deserialize<'de>> Visitor<'de> for Capped<BTreeMap<K, V>> {
    type Value = BTreeMap<K, V>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "an object of at most {} {}", self.cap, self.what)
    }

    fn visit_map<A: MapAccess<'de>>(self, mut map: A) -> Result<Self::Value, A::Error> {
        let mut out = BTreeMap::new();
        // Entries are counted as they come: a repeated key counts again,
        // so that the parse stops at `cap` entries whatever they are.
        let mut seen = 0usize;
        while let Some((k, v)) = map.next_entry()? {
            if seen == self.cap {
                return Err(too_many(self.cap, self.what));
            }
            seen += 1;
            out.insert(k, v);
        }
        Ok(out)
    }
}

/// The visitor of an optional capped list.
struct Optional<T> {
    cap: usize,
    what: &'static str,
    kind: PhantomData<T>,
}

impl<'de, T: Deserialize<'de>> Visitor<'de> for Optional<T> {
    type Value = Option<Vec<T>>;

    fn expecting(&self, f: &mut fmt::Formatter<'_>) -> fmt::Result {
        write!(f, "null or a list of at most {} {}", self.cap, self.what)
    }

    fn visit_none<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_unit<E: de::Error>(self) -> Result<Self::Value, E> {
        Ok(None)
    }

    fn visit_some<D: Deserializer<'de>>(self, d: D) -> Result<Self::Value, D::Error> {
        seq(d, self.cap, self.what).map(Some)
    }
}

/// Is `raw` (a list or an object) empty, or absent?
pub fn empty(raw: Option<&RawValue>) -> bool {
    raw.is_none_or(|r| r.get().chars().filter(|c| !c.is_whitespace()).take(3).count() == 2)
}

/// `{"args": A, "kwargs": K}` as JSON text, from what a client sent as
/// `args` (a list) and `kwargs` (an object), each as its own bytes and
/// either absent (empty); `field` prefixes a refusal (`actor.`, or "").
pub fn arguments(args: Option<&RawValue>, kwargs: Option<&RawValue>, field: &str) -> Result<String, String> {
    let args = args.map_or("[]", |r| r.get().trim());
    let kwargs = kwargs.map_or("{}", |r| r.get().trim());
    if !args.starts_with('[') {
        return Err(format!("{field}args: a list of JSON values, not {}", kind(args)));
    }
    if !kwargs.starts_with('{') {
        return Err(format!("{field}kwargs: an object of JSON values, not {}", kind(kwargs)));
    }
    Ok(format!(r#"{{"args":{args},"kwargs":{kwargs}}}"#))
}

/// The length of what [`arguments`] makes of `args` and `kwargs`, known
/// before it is made (a refusal for size then copies nothing).
pub fn encoded_len(args: Option<&RawValue>, kwargs: Option<&RawValue>) -> usize {
    let args = args.map_or(2, |r| r.get().trim().len());
    let kwargs = kwargs.map_or(2, |r| r.get().trim().len());
    r#"{"args":,"kwargs":}"#.len() + args + kwargs
}

/// What kind of JSON value `text` is, in words.
fn kind(text: &str) -> &'static str {
    match text.as_bytes().first() {
        Some(b'{') => "an object",
        Some(b'[') => "a list",
        Some(b'"') => "a string",
        Some(b't' | b'f') => "a boolean",
        Some(b'n') => "null",
        _ => "a number",
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[derive(Debug, Deserialize)]
    struct Probe {
        #[serde(default, deserialize_with = "three")]
        list: Vec<u32>,
        #[serde(default, deserialize_with = "two")]
        map: BTreeMap<String, String>,
        #[serde(default, deserialize_with = "maybe")]
        ranks: Option<Vec<u32>>,
        #[serde(default)]
        args: Option<Box<RawValue>>,
    }

    fn three<'de, D: Deserializer<'de>>(d: D) -> Result<Vec<u32>, D::Error> {
        seq(d, 3, "numbers")
    }

    fn two<'de, D: Deserializer<'de>>(d: D) -> Result<BTreeMap<String, String>, D::Error> {
        map(d, 2, "names")
    }

    fn maybe<'de, D: Deserializer<'de>>(d: D) -> Result<Option<Vec<u32>>, D::Error> {
        option_seq(d, 2, "ranks")
    }

    fn parse(text: &str) -> Result<Probe, String> {
        serde_json::from_str(text).map_err(|e| e.to_string())
    }

    #[test]
    fn lists_and_maps_stop_at_their_cap_and_say_which() {
        let p = parse(r#"{"list": [1, 2, 3], "map": {"a": "1", "b": "2"}, "ranks": [0, 1]}"#).expect("within");
        assert_eq!((p.list, p.map.len(), p.ranks), (vec![1, 2, 3], 2, Some(vec![0, 1])));
        assert_eq!(parse(r#"{"ranks": null}"#).expect("null").ranks, None);
        for (text, says) in [
            (r#"{"list": [1, 2, 3, 4]}"#, "more than 3 numbers"),
            (r#"{"map": {"a": "1", "a": "2", "a": "3"}}"#, "more than 2 names"),
            (r#"{"ranks": [0, 1, 2]}"#, "more than 2 ranks"),
            // Refused at the fourth element: the rest is never read.
            (r#"{"list": [1, 2, 3, 4, oops"#, "more than 3 numbers"),
        ] {
            let e = parse(text).expect_err(text);
            assert!(e.contains(says), "{text}: {e}");
        }
    }

    #[test]
    fn arguments_stay_the_text_they_came_as() {
        let p = parse(r#"{"args": [1, {"x": [2.50]}] }"#).expect("raw");
        assert_eq!(arguments(p.args.as_deref(), None, "").expect("ok"), r#"{"args":[1, {"x": [2.50]}],"kwargs":{}}"#);
        assert_eq!(arguments(None, None, "").expect("ok"), r#"{"args":[],"kwargs":{}}"#);
        assert_eq!(encoded_len(p.args.as_deref(), None), r#"{"args":[1, {"x": [2.50]}],"kwargs":{}}"#.len());
        let p = parse(r#"{"args": {"a": 1}}"#).expect("raw");
        let e = arguments(p.args.as_deref(), None, "actor.").expect_err("not a list");
        assert_eq!(e, "actor.args: a list of JSON values, not an object");
        assert!(parse(r#"{"args": [1, }"#).is_err(), "raw values are still validated");
        assert!(empty(None) && empty(parse(r#"{"args": [ ]}"#).expect("raw").args.as_deref()));
        assert!(!empty(parse(r#"{"args": [0]}"#).expect("raw").args.as_deref()));
    }
}
