//! Images in requests: every API's image part becomes a [`ChatImage`] that remembers the field it
//! came from, so a picture that cannot be fetched, decoded or fitted is named as the client
//! wrote it. In the message text an image stands as [`IMAGE_PLACEHOLDER`], what the Qwen3.5 /
//! Qwen3.6 templates render for an image part.

use nextn_engine::media::IMAGE_PLACEHOLDER;
use serde_json::Value;

use crate::error::ApiError;

/// An image content part as the request sent it: the field it came from and where its encoded
/// bytes (PNG, JPEG, WebP, GIF) are.
#[derive(Clone, Debug, PartialEq)]
pub struct ChatImage {
    pub source: ImageSource,
    pub field: String,
}

/// Where an image's bytes are: in the request, or behind an http(s) URL that the handler fetches
/// (`--allow-image-urls`, see [`crate::image_url`]) before the request is prepared.
#[derive(Clone, Debug, PartialEq)]
pub enum ImageSource {
    Inline(Vec<u8>),
    Remote(String),
}

impl ChatImage {
    pub fn inline(bytes: Vec<u8>, field: impl Into<String>) -> Self {
        ChatImage {
            source: ImageSource::Inline(bytes),
            field: field.into(),
        }
    }

    /// The URL still to fetch, if the image is one.
    pub fn remote_url(&self) -> Option<&str> {
        match &self.source {
            ImageSource::Remote(u) => Some(u),
            ImageSource::Inline(_) => None,
        }
    }

    /// The image's bytes; an image still behind its URL has none yet (the handlers fetch every
    /// URL before preparing, so that is the server's fault).
    pub fn bytes(&self) -> Result<&[u8], ApiError> {
        match &self.source {
            ImageSource::Inline(b) => Ok(b),
            ImageSource::Remote(_) => Err(ApiError::internal(format!(
                "{}: the image URL was not fetched before the prompt was prepared",
                self.field
            ))),
        }
    }
}

/// A message's text in the making, with its images: each image goes into `images` and stands
/// in the text as the template's placeholder.
#[derive(Default)]
pub(crate) struct MessageText {
    pub text: String,
}

impl MessageText {
    pub fn push_str(&mut self, s: &str) {
        self.text.push_str(s);
    }

    pub fn push_image(&mut self, image: ChatImage, images: &mut Vec<ChatImage>) {
        images.push(image);
        self.text.push_str(IMAGE_PLACEHOLDER);
    }
}

/// An image given as a URL: a `data:image/...;base64,...` URI decoded here, or an `http://` /
/// `https://` URL kept for the handler to fetch (or refuse, without `--allow-image-urls`).
pub fn image_from_url(url: &str, field: &str) -> Result<ChatImage, ApiError> {
    let Some(rest) = strip_prefix_ignore_case(url, "data:") else {
        return remote_image(url, field);
    };
    let Some((media, data)) = rest.split_once(',') else {
        return Err(ApiError::invalid_field(
            field,
            "the data URI has no ',' before its data",
        ));
    };
    if !media.ends_with(";base64") {
        return Err(ApiError::invalid_field(
            field,
            "the data URI must be base64-encoded (data:image/...;base64,...)",
        ));
    }
    image_from_base64(data, field)
}

/// Base64 data of an image given inline (Anthropic's `source.data`, llama-server's
/// `multimodal_data`).
pub(crate) fn image_from_base64(data: &str, field: &str) -> Result<ChatImage, ApiError> {
    use base64::Engine as _;
    let bytes = base64::engine::general_purpose::STANDARD
        .decode(data.trim())
        .map_err(|e| {
            ApiError::invalid_field(field, format!("the image's base64 data is invalid: {e}"))
        })?;
    Ok(ChatImage::inline(bytes, field))
}

/// URL schemes are case-insensitive (RFC 3986), so `DATA:` and `HTTPS://` count too.
fn strip_prefix_ignore_case<'a>(s: &'a str, prefix: &str) -> Option<&'a str> {
    let head = s.get(..prefix.len())?;
    head.eq_ignore_ascii_case(prefix)
        .then(|| &s[prefix.len()..])
}

/// An image URL that is not a data URI: an absolute `http://` or `https://` URL with a host, to be
/// fetched later; any other scheme is refused here.
fn remote_image(url: &str, field: &str) -> Result<ChatImage, ApiError> {
    let inline = "send the image inline as a data URI (data:image/png;base64,...)";
    let parsed = match reqwest::Url::parse(url) {
        Ok(u) => u,
        Err(e)
            if strip_prefix_ignore_case(url, "http://").is_some()
                || strip_prefix_ignore_case(url, "https://").is_some() =>
        {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: the image URL is not a valid URL ({e})"),
            ))
        }
        Err(_) => {
            return Err(ApiError::invalid_field(
                field,
                format!("{field}: an image URL must be a data URI or an http(s) URL: {inline}"),
            ))
        }
    };
    match parsed.scheme() {
        // Both are special schemes: a URL that parsed has a host.
        "http" | "https" => Ok(ChatImage {
            source: ImageSource::Remote(parsed.into()),
            field: field.to_string(),
        }),
        other => Err(ApiError::invalid_field(
            field,
            format!("{field}: image URLs with the scheme '{other}:' are not fetched (only http:// and https://): {inline}"),
        )),
    }
}

/// An image part's `detail`: `auto`, `low` and `high` are accepted (the SDKs' types require one)
/// and mean the same here: pictures are sized within the vision tower's pixel bounds, as
/// llama-server does.
pub(crate) fn check_detail(v: Option<&Value>, field: &str) -> Result<(), ApiError> {
    match v {
        None | Some(Value::Null) => Ok(()),
        Some(Value::String(d)) if matches!(d.as_str(), "auto" | "low" | "high") => Ok(()),
        Some(_) => Err(ApiError::invalid_field(
            field,
            format!("'{field}' must be \"auto\", \"low\" or \"high\""),
        )),
    }
}

/// An OpenAI `image_url` part (`field` is the part's path): `{"url": ..., "detail": ...}` or the
/// URL as a string.
pub(crate) fn image_url_part(p: &Value, field: &str) -> Result<ChatImage, ApiError> {
    let url = match p.get("image_url") {
        Some(Value::String(u)) => u,
        Some(Value::Object(o)) => {
            check_detail(o.get("detail"), &format!("{field}.image_url.detail"))?;
            match o.get("url") {
                Some(Value::String(u)) => u,
                _ => {
                    return Err(ApiError::invalid_field(
                        &format!("{field}.image_url.url"),
                        "an image_url part needs a 'url' string",
                    ))
                }
            }
        }
        _ => {
            return Err(ApiError::invalid_field(
                field,
                "an image_url part needs an 'image_url' object with a 'url'",
            ))
        }
    };
    image_from_url(url, &format!("{field}.image_url.url"))
}

/// A request with more than `max` images is refused before any is fetched or decoded, naming
/// the first image over the cap.
pub(crate) fn check_image_count(images: &[ChatImage], max: usize) -> Result<(), ApiError> {
    match images.get(max) {
        None => Ok(()),
        Some(over) => Err(ApiError::invalid_field(
            &over.field,
            format!(
                "the request has {} images; at most {max} are read per request (the server's --max-images)",
                images.len()
            ),
        )),
    }
}

#[cfg(test)]
mod tests {
    use super::*;
    use serde_json::json;

    #[test]
    fn detail_values_the_sdks_send_are_accepted() {
        for d in ["auto", "low", "high"] {
            let p = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": d}});
            assert!(image_url_part(&p, "messages[0].content[0]").is_ok(), "{d}");
        }
        let p = json!({"type": "image_url", "image_url": {"url": "data:image/png;base64,AAAA", "detail": "ultra"}});
        let e = image_url_part(&p, "messages[0].content[0]").unwrap_err();
        assert_eq!(
            e.param.as_deref(),
            Some("messages[0].content[0].image_url.detail")
        );
    }

    #[test]
    fn the_image_over_the_cap_is_named() {
        let images: Vec<ChatImage> = (0..3)
            .map(|k| ChatImage::inline(vec![], format!("messages[0].content[{k}]")))
            .collect();
        assert!(check_image_count(&images, 3).is_ok());
        let e = check_image_count(&images, 2).unwrap_err();
        assert_eq!(e.param.as_deref(), Some("messages[0].content[2]"));
    }
}
