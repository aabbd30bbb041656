//! The configuration reference in each filter's README (and the native
//! module's `native` section in its own), generated from the config structs: their JSON Schema (`schemars`, feature `schema`, which
//! honours the serde attributes: defaults, renames, unknown fields refused)
//! rendered as Markdown tables — field, type, required, default and the
//! field's doc comment — with a sub-table per nested object. The tables sit
//! between `<!-- config:begin -->` and `<!-- config:end -->`; this test fails
//! when a README's differs from what the code says, so the two cannot
//! drift. To update the READMEs after changing a config struct or its doc
//! comments:
//!
//! ```sh
//! ZEROLAYER_UPDATE_DOCS=1 cargo test -p zerolayer-core --test config_docs
//! ```

use std::collections::BTreeSet;
use std::path::{Path, PathBuf};

use schemars::{JsonSchema, Schema, schema_for};
use serde_json::{Map, Value};

use zerolayer_core::activation::ActivationConfig;
use zerolayer_core::auth::config::LazyAuthConfig;
use zerolayer_core::cache::config::PostCacheConfig;
use zerolayer_core::metering::config::MeteringConfig;
use zerolayer_core::native::NativeSection;
use zerolayer_core::quota::config::QuotaConfig;

const BEGIN: &str = "<!-- config:begin -->";
const END: &str = "<!-- config:end -->";
const UPDATE: &str = "ZEROLAYER_UPDATE_DOCS";

/// One filter's README and the configuration type it documents.
struct Reference {
    /// The filter's name as in `filters/<name>`.
    filter: &'static str,
    /// The schema of the filter's configuration.
    schema: Schema,
}

fn references() -> Vec<Reference> {
    fn of<T: JsonSchema>(filter: &'static str) -> Reference {
        Reference {
            filter,
            schema: schema_for!(T),
        }
    }
    vec![
        of::<ActivationConfig>("activation"),
        of::<LazyAuthConfig>("lazy-auth"),
        of::<PostCacheConfig>("post-cache"),
        of::<MeteringConfig>("metering"),
        of::<QuotaConfig>("quota"),
        // The native module's own section (`native`), beside the stages'.
        of::<NativeSection>("native"),
    ]
}

fn readme(filter: &str) -> PathBuf {
    Path::new(env!("CARGO_MANIFEST_DIR"))
        .join("..")
        .join(filter)
        .join("README.md")
}

#[test]
fn readme_configuration_tables_match_the_config_structs() {
    let update = std::env::var_os(UPDATE).is_some_and(|v| v == "1");
    let mut stale = Vec::new();
    for reference in references() {
        let path = readme(reference.filter);
        let text =
            std::fs::read_to_string(&path).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        let generated = render(reference.schema.as_value());
        let updated = replace_section(&text, &generated)
            .unwrap_or_else(|e| panic!("{}: {e}", path.display()));
        if updated == text {
            continue;
        }
        if update {
            std::fs::write(&path, updated).unwrap_or_else(|e| panic!("{}: {e}", path.display()));
            eprintln!("updated {}", path.display());
        } else {
            stale.push(path.display().to_string());
        }
    }
    assert!(
        stale.is_empty(),
        "the configuration reference in {} differs from the config structs in filters/core; \
         regenerate it with `{UPDATE}=1 cargo test -p zerolayer-core --test config_docs` \
         (the tables come from the structs' doc comments and serde attributes: edit those, \
         not the tables)",
        stale.join(", ")
    );
}

/// `text` with what lies between the markers replaced by `generated`.
fn replace_section(text: &str, generated: &str) -> Result<String, String> {
    let start = text
        .find(BEGIN)
        .ok_or_else(|| format!("no {BEGIN} marker"))?;
    let end = text.find(END).ok_or_else(|| format!("no {END} marker"))?;
    if end < start || text[start + BEGIN.len()..].contains(BEGIN) {
        return Err(format!("expected one {BEGIN} before one {END}"));
    }
    Ok(format!(
        "{}{BEGIN}\n{generated}{}",
        &text[..start],
        &text[end..]
    ))
}

#[test]
fn the_section_between_the_markers_is_replaced() {
    let text = format!("intro\n{BEGIN}\nold\n{END}\noutro\n");
    assert_eq!(
        replace_section(&text, "new\n").as_deref(),
        Ok(format!("intro\n{BEGIN}\nnew\n{END}\noutro\n").as_str())
    );
    assert!(replace_section("no markers", "x").is_err());
    assert!(replace_section(&format!("{END}\n{BEGIN}"), "x").is_err());
}

/// The tables of a configuration schema: its own fields, then one table per
/// object type it uses, in the order they are first reached.
fn render(root: &Value) -> String {
    let defs = root
        .get("$defs")
        .and_then(Value::as_object)
        .cloned()
        .unwrap_or_default();
    let renderer = Renderer { defs: &defs };
    let mut out = String::from(
        "<!-- Generated from the config structs in filters/core by filters/core/tests/config_docs.rs: \
         edit their doc comments, then run \
         `ZEROLAYER_UPDATE_DOCS=1 cargo test -p zerolayer-core --test config_docs`. -->\n\n",
    );
    // Types to render, with the field paths that reach them.
    let mut queue: Vec<(String, Vec<String>)> = Vec::new();
    out.push_str(&renderer.table(root, "", &mut queue));
    let mut done = BTreeSet::new();
    let mut i = 0;
    while i < queue.len() {
        let (name, paths) = queue[i].clone();
        i += 1;
        if !done.insert(name.clone()) {
            continue;
        }
        let Some(def) = defs.get(&name) else {
            continue;
        };
        out.push_str(&format!("\n### `{name}`\n\n"));
        if let Some(description) = def.get("description").and_then(Value::as_str) {
            out.push_str(&prose(description));
            out.push(' ');
        }
        let uses: Vec<String> = paths.iter().map(|p| format!("`{p}`")).collect();
        out.push_str(&format!("Used as {}.\n\n", uses.join(", ")));
        let prefix = paths.first().cloned().unwrap_or_default();
        out.push_str(&renderer.table(def, &prefix, &mut queue));
    }
    out
}

struct Renderer<'a> {
    defs: &'a Map<String, Value>,
}

impl Renderer<'_> {
    /// The table of an object's fields (or of an enum's one-member objects),
    /// queueing the object types it refers to.
    fn table(
        &self,
        schema: &Value,
        prefix: &str,
        queue: &mut Vec<(String, Vec<String>)>,
    ) -> String {
        let mut out = String::new();
        let mut rows = Vec::new();
        if let Some(variants) = schema.get("oneOf").and_then(Value::as_array) {
            out.push_str("Exactly one of these members:\n\n");
            for variant in variants {
                let Some((key, member)) = variant
                    .get("properties")
                    .and_then(Value::as_object)
                    .and_then(|p| p.iter().next())
                else {
                    continue;
                };
                let path = join(prefix, key);
                self.queue_refs(member, &path, queue);
                rows.push([
                    format!("`{key}`"),
                    self.type_of(member),
                    "one of".into(),
                    "—".into(),
                    variant
                        .get("description")
                        .and_then(Value::as_str)
                        .map(prose)
                        .unwrap_or_default(),
                ]);
            }
        } else {
            let required: BTreeSet<&str> = schema
                .get("required")
                .and_then(Value::as_array)
                .map(|r| r.iter().filter_map(Value::as_str).collect())
                .unwrap_or_default();
            let properties = schema
                .get("properties")
                .and_then(Value::as_object)
                .cloned()
                .unwrap_or_default();
            for (key, property) in &properties {
                let path = join(prefix, key);
                self.queue_refs(property, &path, queue);
                let required = required.contains(key.as_str());
                let default = match property.get("default") {
                    Some(value) => self.default_of(property, value),
                    None => "—".into(),
                };
                rows.push([
                    format!("`{key}`"),
                    self.type_of(property),
                    if required { "yes" } else { "no" }.into(),
                    default,
                    self.description_of(property),
                ]);
            }
        }
        out.push_str("| field | type | required | default | description |\n");
        out.push_str("| --- | --- | --- | --- | --- |\n");
        for row in rows {
            let cells: Vec<String> = row.iter().map(|c| c.replace('|', "\\|")).collect();
            out.push_str(&format!("| {} |\n", cells.join(" | ")));
        }
        out
    }

    /// The definition a `$ref` names.
    fn def<'s>(&'s self, schema: &Value) -> Option<(&'s str, &'s Value)> {
        let name = schema.get("$ref")?.as_str()?.strip_prefix("#/$defs/")?;
        self.defs.get_key_value(name).map(|(k, v)| (k.as_str(), v))
    }

    /// `schema` without its `null` alternative (an `Option`'s).
    fn non_null<'s>(&self, schema: &'s Value) -> &'s Value {
        if let Some(any_of) = schema.get("anyOf").and_then(Value::as_array) {
            let rest: Vec<&Value> = any_of
                .iter()
                .filter(|s| s.get("type") != Some(&Value::from("null")))
                .collect();
            if let [only] = rest.as_slice() {
                return only;
            }
        }
        schema
    }

    /// Queues the object types `schema` refers to, reached at `path`.
    fn queue_refs(&self, schema: &Value, path: &str, queue: &mut Vec<(String, Vec<String>)>) {
        let schema = self.non_null(schema);
        if let Some((name, def)) = self.def(schema) {
            if string_values(def).is_none() {
                match queue.iter_mut().find(|(n, _)| n == name) {
                    Some((_, paths)) => {
                        if !paths.iter().any(|p| p == path) {
                            paths.push(path.to_string());
                        }
                    }
                    None => queue.push((name.to_string(), vec![path.to_string()])),
                }
            }
        } else if let Some(items) = schema.get("items") {
            self.queue_refs(items, &format!("{path}[]"), queue);
        } else if let Some(values) = schema.get("additionalProperties").filter(|v| v.is_object()) {
            self.queue_refs(values, &format!("{path}.*"), queue);
        }
    }

    /// The type column: JSON types, enums' values, links to sub-tables.
    fn type_of(&self, schema: &Value) -> String {
        let schema = self.non_null(schema);
        if let Some((name, def)) = self.def(schema) {
            return match string_values(def) {
                Some(values) => values
                    .iter()
                    .map(|(v, _)| format!("`\"{v}\"`"))
                    .collect::<Vec<_>>()
                    .join(" | "),
                None => format!("[`{name}`](#{})", name.to_lowercase()),
            };
        }
        if let Some(values) = string_values(schema) {
            return values
                .iter()
                .map(|(v, _)| format!("`\"{v}\"`"))
                .collect::<Vec<_>>()
                .join(" | ");
        }
        let ty = match schema.get("type") {
            Some(Value::String(t)) => t.as_str(),
            Some(Value::Array(types)) => types
                .iter()
                .filter_map(Value::as_str)
                .find(|t| *t != "null")
                .unwrap_or("null"),
            _ => return "any JSON".into(),
        };
        match ty {
            "array" => match schema.get("items") {
                Some(items) if items.is_object() => format!("array of {}", self.type_of(items)),
                _ => "array of any JSON".into(),
            },
            "object" => match schema.get("additionalProperties") {
                Some(values) if values.is_object() => {
                    format!("map: string → {}", self.type_of(values))
                }
                _ => "object".into(),
            },
            "integer" => {
                let min = schema.get("minimum").and_then(Value::as_i64);
                let max = schema.get("maximum").and_then(Value::as_i64);
                match (min, max) {
                    (Some(min), Some(max)) if max <= 65_535 => format!("integer {min}–{max}"),
                    (Some(0), _) => "integer ≥ 0".into(),
                    _ => "integer".into(),
                }
            }
            other => other.into(),
        }
    }

    /// The description column: the field's doc comment, and what each of
    /// its enum's values means.
    fn description_of(&self, property: &Value) -> String {
        let mut text = property
            .get("description")
            .and_then(Value::as_str)
            .map(prose)
            .unwrap_or_default();
        let schema = self.non_null(property);
        let values = match self.def(schema) {
            Some((_, def)) => string_values(def),
            None => string_values(schema),
        };
        let explained: Vec<String> = values
            .unwrap_or_default()
            .into_iter()
            .filter_map(|(v, d)| d.map(|d| format!("`{v}`: {}", prose(&d))))
            .collect();
        if !explained.is_empty() {
            if !text.is_empty() {
                text.push(' ');
            }
            text.push_str(&explained.join(" "));
        }
        text
    }

    /// The default column: the value in JSON (nulls left out: absent), or
    /// "fields' defaults" when an object's default is what its own fields'
    /// defaults make.
    fn default_of(&self, property: &Value, value: &Value) -> String {
        if value.is_null() {
            return "none".into();
        }
        if value.is_object()
            && let Some((_, def)) = self.def(self.non_null(property))
            && fields_defaults(def).as_ref() == Some(&without_nulls(value))
        {
            return "its fields' defaults".into();
        }
        format!("`{}`", without_nulls(value))
    }
}

/// The values of a string enum, with each value's doc comment if it has one.
fn string_values(schema: &Value) -> Option<Vec<(String, Option<String>)>> {
    if let Some(values) = schema.get("enum").and_then(Value::as_array) {
        return values
            .iter()
            .map(|v| v.as_str().map(|s| (s.to_string(), None)))
            .collect();
    }
    schema
        .get("oneOf")?
        .as_array()?
        .iter()
        .map(|variant| {
            let value = variant.get("const")?.as_str()?.to_string();
            let doc = variant
                .get("description")
                .and_then(Value::as_str)
                .map(str::to_string);
            Some((value, doc))
        })
        .collect()
}

/// The object an object schema's field defaults make, if every field has one.
fn fields_defaults(def: &Value) -> Option<Value> {
    let properties = def.get("properties")?.as_object()?;
    let mut object = Map::new();
    for (key, property) in properties {
        object.insert(key.clone(), property.get("default")?.clone());
    }
    Some(without_nulls(&Value::Object(object)))
}

/// `value` with null object members removed (a null member means absent).
fn without_nulls(value: &Value) -> Value {
    match value {
        Value::Object(members) => Value::Object(
            members
                .iter()
                .filter(|(_, v)| !v.is_null())
                .map(|(k, v)| (k.clone(), without_nulls(v)))
                .collect(),
        ),
        Value::Array(items) => Value::Array(items.iter().map(without_nulls).collect()),
        other => other.clone(),
    }
}

/// A doc comment as one table cell: lines joined, intra-doc links as code.
fn prose(doc: &str) -> String {
    let text = doc.split_whitespace().collect::<Vec<_>>().join(" ");
    // "[`RuleConfig`]" is a rustdoc link; in a README it is just the name.
    let mut out = String::with_capacity(text.len());
    let mut rest = text.as_str();
    while let Some(at) = rest.find("[`") {
        out.push_str(&rest[..at]);
        let after = &rest[at + 1..];
        match after.find("`]") {
            Some(close) if !after[close + 2..].starts_with('(') => {
                out.push_str(&after[..close + 1]);
                rest = &after[close + 2..];
            }
            _ => {
                out.push('[');
                rest = after;
            }
        }
    }
    out.push_str(rest);
    out
}

fn join(prefix: &str, key: &str) -> String {
    if prefix.is_empty() {
        key.to_string()
    } else {
        format!("{prefix}.{key}")
    }
}

#[test]
fn doc_links_become_code_and_lines_join() {
    assert_eq!(
        prose("The rules, see [`RuleConfig`].\nNext line."),
        "The rules, see `RuleConfig`. Next line."
    );
    assert_eq!(prose("[`a`](b) and [x]"), "[`a`](b) and [x]");
}
