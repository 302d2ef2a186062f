//! Framing: a 4-byte big-endian length N, then N bytes of UTF-8 JSON (pyisolate's
//! `JSONSocketTransport`). Decoding is incremental and bounded: a declared length over the
//! cap is an error at once (before any allocation for it), and the buffer only ever holds
//! bytes that actually arrived — a peer that announces a large frame and sends nothing
//! costs nothing.

use crate::error::{Result, RpcError};

/// Default cap on one frame: 64 MiB (pyisolate's own hard limit is 2 GiB; large data goes
/// out of band here).
pub const DEFAULT_MAX_FRAME: usize = 64 << 20;

/// Header + payload.
pub fn encode_frame(payload: &[u8]) -> Result<Vec<u8>> {
    let n = u32::try_from(payload.len())
        .map_err(|_| RpcError::InvalidArgument(format!("frame of {} bytes does not fit a 32-bit length", payload.len())))?;
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&n.to_be_bytes());
    out.extend_from_slice(payload);
    Ok(out)
}

/// Look at the start of `buf`: `Ok(Some((header_len, payload_len)))` once a whole frame is
/// there, `Ok(None)` if more bytes are needed, `Err` if the declared length is over `cap`.
pub fn peek_frame(buf: &[u8], cap: usize) -> Result<Option<(usize, usize)>> {
    let Some(h) = buf.get(..4) else { return Ok(None) };
    let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as u64;
    if len > cap as u64 {
        return Err(RpcError::FrameTooLarge { len, cap });
    }
    let len = len as usize;
    if buf.len() - 4 >= len { Ok(Some((4, len))) } else { Ok(None) }
}

/// Incremental decoder: push bytes as they arrive, pop whole frames.
#[derive(Debug)]
pub struct FrameDecoder {
    buf: Vec<u8>,
    start: usize,
    cap: usize,
}

impl FrameDecoder {
    pub fn new(cap: usize) -> FrameDecoder {
        FrameDecoder { buf: Vec::new(), start: 0, cap }
    }

    /// Append received bytes.
    pub fn push(&mut self, data: &[u8]) {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
        } else if self.start > 64 * 1024 && self.start * 2 > self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        self.buf.extend_from_slice(data);
    }

    /// Bytes received but not yet returned as frames.
    pub fn buffered(&self) -> usize {
        self.buf.len() - self.start
    }

    /// The next whole frame's payload, if one is buffered. After an error the decoder is
    /// poisoned for this peer (the stream cannot be resynchronized).
    pub fn next_frame(&mut self) -> Result<Option<&[u8]>> {
        match peek_frame(&self.buf[self.start..], self.cap)? {
            None => Ok(None),
            Some((h, n)) => {
                let s = self.start + h;
                self.start = s + n;
                Ok(Some(&self.buf[s..s + n]))
            }
        }
    }
}

#[cfg(test)]
mod tests {
    use super::*;

    #[test]
    fn split_and_joined_frames() {
        let mut wire = encode_frame(b"{\"a\": 1}").unwrap();
        wire.extend(encode_frame(b"null").unwrap());
        wire.extend(encode_frame(b"").unwrap());
        let mut d = FrameDecoder::new(100);
        let mut got = Vec::new();
        for b in &wire {
            d.push(std::slice::from_ref(b));
            while let Some(f) = d.next_frame().unwrap() {
                got.push(f.to_vec());
            }
        }
        assert_eq!(got, vec![b"{\"a\": 1}".to_vec(), b"null".to_vec(), vec![]]);
        assert_eq!(d.buffered(), 0);
    }

    #[test]
    fn oversize_is_an_error_before_any_payload() {
        let mut d = FrameDecoder::new(1024);
        d.push(&0xFFFF_FFFFu32.to_be_bytes());
        let e = d.next_frame().unwrap_err();
        assert!(matches!(e, RpcError::FrameTooLarge { len: 0xFFFF_FFFF, cap: 1024 }), "{e}");
        assert!(d.buffered() < 16);
        let mut d = FrameDecoder::new(4);
        d.push(&[0, 0, 0, 4, 1, 2, 3]);
        assert!(d.next_frame().unwrap().is_none(), "truncated frame waits for more");
    }
}
