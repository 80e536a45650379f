//! Integers as vLLM's request models take them: a JSON integer, or a number with no fractional
//! part (`"max_tokens": 100.0`, as clients send computed values). A fraction, or a value the
//! field's type cannot hold, is refused, and the path of the error names the field.

use serde::de::Error;
use serde::{Deserialize, Deserializer};

/// For `#[serde(default, deserialize_with = "lax_integer::option")]` on an `Option` of an integer.
pub fn option<'de, D, T>(deserializer: D) -> Result<Option<T>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    Option::<serde_json::Number>::deserialize(deserializer)?
        .map(|number| fit(&number).ok_or_else(|| misfit::<D::Error, T>(&number)))
        .transpose()
}

/// For `#[serde(deserialize_with = "lax_integer::integer")]` on an integer (an enum's variant).
pub fn integer<'de, D, T>(deserializer: D) -> Result<T, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    let number = serde_json::Number::deserialize(deserializer)?;
    fit(&number).ok_or_else(|| misfit::<D::Error, T>(&number))
}

/// For `#[serde(default, deserialize_with = "lax_integer::option_list")]` on an `Option` of a
/// list of integers (token ids).
pub fn option_list<'de, D, T>(deserializer: D) -> Result<Option<Vec<T>>, D::Error>
where
    D: Deserializer<'de>,
    T: TryFrom<i64> + TryFrom<u64>,
{
    Option::<Vec<serde_json::Number>>::deserialize(deserializer)?
        .map(|numbers| {
            numbers
                .iter()
                .map(|number| fit(number).ok_or_else(|| misfit::<D::Error, T>(number)))
                .collect()
        })
        .transpose()
}

/// `number` as a `T`, if it is a whole number `T` holds.
fn fit<T: TryFrom<i64> + TryFrom<u64>>(number: &serde_json::Number) -> Option<T> {
    if let Some(value) = number.as_i64() {
        T::try_from(value).ok()
    } else if let Some(value) = number.as_u64() {
        T::try_from(value).ok()
    } else {
        // A float: whole and strictly inside i64's range (an integer literal past it is read as
        // the nearest f64, and −2^63 − 1 rounds to −2^63: only integers, read above, reach the
        // ends exactly).
        let limit = 2f64.powi(63);
        number
            .as_f64()
            .filter(|value| value.fract() == 0.0 && value.abs() < limit)
            .and_then(|value| T::try_from(value as i64).ok())
    }
}

fn misfit<E: Error, T>(number: &serde_json::Number) -> E {
    E::custom(format!(
        "invalid value: {number}, expected a whole number that fits {}",
        std::any::type_name::<T>()
    ))
}

#[cfg(test)]
mod tests {
    use serde::Deserialize;

    #[derive(Debug, Deserialize)]
    struct Body {
        #[serde(default, deserialize_with = "super::option")]
        count: Option<u32>,
        #[serde(default, deserialize_with = "super::option")]
        seed: Option<i64>,
        #[serde(default, deserialize_with = "super::option_list")]
        ids: Option<Vec<u32>>,
    }

    fn parse(json: &str) -> Result<Body, serde_json::Error> {
        serde_json::from_str(json)
    }

    #[test]
    fn whole_floats_are_integers_and_the_rest_is_refused() {
        let body = parse(r#"{"count": 100.0, "seed": -3.0}"#).expect("whole floats");
        assert_eq!((body.count, body.seed), (Some(100), Some(-3)));
        let body = parse(r#"{"count": 7, "seed": null}"#).expect("an integer and a null");
        assert_eq!((body.count, body.seed), (Some(7), None));
        let body = parse(r#"{"ids": [1, 2.0, 3]}"#).expect("a list");
        assert_eq!(body.ids, Some(vec![1, 2, 3]));
        assert_eq!(parse("{}").expect("absent").count, None);
        for bad in [
            r#"{"count": 1.5}"#,
            r#"{"count": -1}"#,
            r#"{"count": 5e9}"#,
            r#"{"seed": 9223372036854775808}"#,
            r#"{"seed": -9223372036854775809}"#,
            r#"{"seed": 1e300}"#,
            r#"{"count": "3"}"#,
            r#"{"ids": [1, 2.5]}"#,
            r#"{"ids": [-1]}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad} was taken");
        }
    }
}
