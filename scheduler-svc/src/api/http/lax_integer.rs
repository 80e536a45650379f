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
    let Some(number) = Option::<serde_json::Number>::deserialize(deserializer)? else {
        return Ok(None);
    };
    let fitted = if let Some(value) = number.as_i64() {
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
    };
    fitted.map(Some).ok_or_else(|| {
        D::Error::custom(format!(
            "invalid value: {number}, expected a whole number that fits {}",
            std::any::type_name::<T>()
        ))
    })
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
        assert_eq!(parse("{}").expect("absent").count, None);
        for bad in [
            r#"{"count": 1.5}"#,
            r#"{"count": -1}"#,
            r#"{"count": 5e9}"#,
            r#"{"seed": 9223372036854775808}"#,
            r#"{"seed": -9223372036854775809}"#,
            r#"{"seed": 1e300}"#,
            r#"{"count": "3"}"#,
        ] {
            assert!(parse(bad).is_err(), "{bad} was taken");
        }
    }
}
