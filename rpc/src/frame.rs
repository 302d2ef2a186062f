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
    let mut out = Vec::with_capacity(4 + payload.len());
    out.extend_from_slice(&header(payload.len())?);
    out.extend_from_slice(payload);
    Ok(out)
}

/// The 4-byte header of a `len`-byte frame.
pub fn header(len: usize) -> Result<[u8; 4]> {
    let n = u32::try_from(len).map_err(|_| RpcError::InvalidArgument(format!("frame of {len} bytes does not fit a 32-bit length")))?;
    Ok(n.to_be_bytes())
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

    /// Append received bytes. The buffer grows by doubling, but never past the end of
    /// the frame being received once its header says where that is: a large frame is
    /// held once, not in a buffer up to twice its size. Growth is fallible (an error, not
    /// an abort, when memory or address space runs out).
    pub fn push(&mut self, data: &[u8]) -> Result<()> {
        if self.start > 0 && self.start == self.buf.len() {
            self.buf.clear();
            self.start = 0;
            if self.buf.capacity() > RETAIN_BYTES {
                // Do not keep a large frame's buffer for the life of the connection.
                self.buf = Vec::new();
            }
        } else if self.start > 64 * 1024 && self.start * 2 > self.buf.len() {
            self.buf.drain(..self.start);
            self.start = 0;
        }
        let want = self.buf.len() + data.len();
        if want > self.buf.capacity() {
            let doubled = want.max(self.buf.capacity() * 2);
            let target = match self.declared_end() {
                Some(end) if end >= want => doubled.min(end),
                _ => doubled,
            };
            self.buf.try_reserve_exact(target - self.buf.len()).map_err(|_| RpcError::OutOfMemory {
                what: format!("a frame buffer ({} bytes buffered)", self.buf.len()),
                bytes: target as u64,
            })?;
        }
        self.buf.extend_from_slice(data);
        Ok(())
    }

    /// Where (in `buf`) the frame being received ends, once its header is buffered and
    /// under the cap.
    fn declared_end(&self) -> Option<usize> {
        let h = self.buf.get(self.start..self.start + 4)?;
        let len = u32::from_be_bytes([h[0], h[1], h[2], h[3]]) as usize;
        (len <= self.cap).then(|| self.start + 4 + len)
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

    /// The next whole frame's payload as an owned buffer. A large frame that ends the
    /// buffered bytes is handed over without a copy (the buffer itself, less what came
    /// before it), so it is never held twice.
    pub fn next_frame_owned(&mut self) -> Result<Option<Vec<u8>>> {
        let Some((h, n)) = peek_frame(&self.buf[self.start..], self.cap)? else { return Ok(None) };
        let end = self.start + h + n;
        if n > RETAIN_BYTES && end == self.buf.len() {
            let mut whole = std::mem::take(&mut self.buf);
            whole.drain(..self.start + h);
            self.start = 0;
            return Ok(Some(whole));
        }
        Ok(self.next_frame()?.map(<[u8]>::to_vec))
    }
}

/// Buffers larger than this are handed over or released rather than kept for reuse.
const RETAIN_BYTES: usize = 1 << 20;

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
            d.push(std::slice::from_ref(b)).unwrap();
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
        d.push(&0xFFFF_FFFFu32.to_be_bytes()).unwrap();
        let e = d.next_frame().unwrap_err();
        assert!(matches!(e, RpcError::FrameTooLarge { len: 0xFFFF_FFFF, cap: 1024 }), "{e}");
        assert!(d.buffered() < 16);
        let mut d = FrameDecoder::new(4);
        d.push(&[0, 0, 0, 4, 1, 2, 3]).unwrap();
        assert!(d.next_frame().unwrap().is_none(), "truncated frame waits for more");
    }

    #[test]
    fn a_large_frame_is_held_once_and_handed_over_without_a_copy() {
        let payload = vec![b'7'; 3 << 20];
        let wire = encode_frame(&payload).unwrap();
        let mut d = FrameDecoder::new(4 << 20);
        for chunk in wire.chunks(64 * 1024) {
            d.push(chunk).unwrap();
            assert!(d.buf.capacity() <= wire.len(), "capacity {} for a {}-byte frame", d.buf.capacity(), wire.len());
        }
        let ptr = d.buf.as_ptr();
        let f = d.next_frame_owned().unwrap().unwrap();
        assert_eq!(f, payload);
        assert_eq!(f.as_ptr(), ptr, "the buffer itself is handed over");
        assert_eq!(d.buffered(), 0);
        d.push(&encode_frame(b"null").unwrap()).unwrap();
        assert_eq!(d.next_frame_owned().unwrap().unwrap(), b"null");
    }
}
