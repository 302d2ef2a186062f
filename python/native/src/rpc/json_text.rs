//! Python objects as the wire's JSON text and back, with no `Value` tree between them.
//!
//! Sending, [`write`] turns a list, tuple or dict straight into the text `json.dumps`
//! writes (`", "` and `": "` separators, floats as `repr` writes them, non-finite ones as
//! `NaN`/`Infinity`), each tensor in it kept aside at its offset and encoded in place when
//! the endpoint writes the frame (`JsonText`). Receiving, [`read`] builds Python objects
//! from a value's text, which the connection's parser checked within its decode limits
//! (`RpcConfig::json_text`): a value holding a tagged object (a tensor, a pyisolate form)
//! comes as the tree instead, and `values` reads that. The reader still checks what it
//! reads, and answers anything malformed with an error, never a panic.

use super::tensors::{MAX_DEPTH, too_deep, tensor_value, type_name};
use crate::errors::refused;
use pyo3::prelude::*;
use pyo3::{Borrowed, ffi};
use pyo3::types::{PyBool, PyDict, PyFloat, PyInt, PyList, PyString, PyTuple};
use std::borrow::Cow;
use std::cell::RefCell;
use tensorwire_rpc::json::lex::{self, Number};
use tensorwire_rpc::{JsonText, Tensor, Value, json};

/// `obj` (a list, tuple or dict) as JSON text.
pub fn write(obj: &Bound<'_, PyAny>) -> PyResult<Value> {
    // The buffer starts at the size of this thread's last text: a caller sending values
    // of one shape grows it once, not by doubling through each call.
    let cap = LAST_LEN.with(|n| n.get()).clamp(256, MAX_START_CAPACITY);
    let mut w = Writer { out: Vec::with_capacity(cap), tensors: Vec::new() };
    w.value(obj.as_borrowed(), 0)?;
    LAST_LEN.with(|n| n.set(w.out.len()));
    // SAFETY: the writer appends only ASCII and whole UTF-8 strings (`write_str` of a
    // `&str`, escaped at ASCII bytes), so the bytes are UTF-8.
    let text = unsafe { String::from_utf8_unchecked(w.out) };
    let text = JsonText::new(text, w.tensors).map_err(|e| super::errors::to_py(obj.py(), &e))?;
    Ok(Value::Json(Box::new(text)))
}

/// The largest buffer a text starts with, however long the last one was.
const MAX_START_CAPACITY: usize = 1 << 20;

thread_local! {
    static LAST_LEN: std::cell::Cell<usize> = const { std::cell::Cell::new(0) };
}

struct Writer {
    out: Vec<u8>,
    tensors: Vec<(usize, Tensor)>,
}

/// The exact type of an object the writer reads directly (a subclass takes the checked
/// path, `Writer::other`).
#[derive(Clone, Copy, PartialEq)]
enum Exact {
    Str,
    Int,
    Float,
    Dict,
    List,
    Tuple,
    Other,
}

fn exact(obj: Borrowed<'_, '_, PyAny>) -> Exact {
    let ty = obj.get_type_ptr();
    if ty == &raw mut ffi::PyUnicode_Type {
        Exact::Str
    } else if ty == &raw mut ffi::PyLong_Type {
        Exact::Int
    } else if ty == &raw mut ffi::PyFloat_Type {
        Exact::Float
    } else if ty == &raw mut ffi::PyDict_Type {
        Exact::Dict
    } else if ty == &raw mut ffi::PyList_Type {
        Exact::List
    } else if ty == &raw mut ffi::PyTuple_Type {
        Exact::Tuple
    } else {
        Exact::Other
    }
}

impl Writer {
    /// One value. Containers' items are read as borrowed references (no reference count
    /// traffic per leaf); an item that is itself a container or any other object is held
    /// by a reference of ours while it is written, since writing it may run Python code
    /// (a tensor's export) that could drop it from its container.
    fn value(&mut self, obj: Borrowed<'_, '_, PyAny>, depth: usize) -> PyResult<()> {
        let py = obj.py();
        if depth > MAX_DEPTH {
            return Err(too_deep(py));
        }
        match exact(obj) {
            Exact::Str => self.str(obj),
            Exact::Int => self.int(obj),
            Exact::Float => {
                // SAFETY: `obj` is exactly a float.
                let f = unsafe { ffi::PyFloat_AsDouble(obj.as_ptr()) };
                json::write_float(&mut self.out, f);
                Ok(())
            }
            Exact::Dict => self.dict(obj, depth),
            Exact::List => {
                self.out.push(b'[');
                let mut n = 0;
                // The length read each time: the list may change while a container or
                // tensor in it is written.
                // SAFETY: `obj` is exactly a list.
                while n < unsafe { ffi::PyList_Size(obj.as_ptr()) } {
                    // SAFETY: `n` is below the list's length: a borrowed reference,
                    // owned by the list.
                    let x = unsafe { Borrowed::from_ptr(py, ffi::PyList_GetItem(obj.as_ptr(), n)) };
                    if n > 0 {
                        self.out.extend_from_slice(b", ");
                    }
                    self.item(x, depth)?;
                    n += 1;
                }
                self.out.push(b']');
                Ok(())
            }
            Exact::Tuple => {
                self.out.push(b'[');
                // SAFETY: `obj` is exactly a tuple (immutable).
                let len = unsafe { ffi::PyTuple_Size(obj.as_ptr()) };
                for n in 0..len {
                    // SAFETY: `n` is below the tuple's length: a borrowed reference,
                    // owned by the tuple, which the caller holds.
                    let x = unsafe { Borrowed::from_ptr(py, ffi::PyTuple_GetItem(obj.as_ptr(), n)) };
                    if n > 0 {
                        self.out.extend_from_slice(b", ");
                    }
                    self.item(x, depth)?;
                }
                self.out.push(b']');
                Ok(())
            }
            Exact::Other => self.other(&obj, depth),
        }
    }

    /// An item of a container: a str, int or float (which run no Python code to write)
    /// as it is borrowed; anything else held by a reference of ours while it is written.
    fn item(&mut self, x: Borrowed<'_, '_, PyAny>, depth: usize) -> PyResult<()> {
        if depth + 1 > MAX_DEPTH {
            return Err(too_deep(x.py()));
        }
        match exact(x) {
            Exact::Str => self.str(x),
            Exact::Int => self.int(x),
            Exact::Float => self.value(x, depth + 1),
            _ => {
                let held = x.to_owned();
                self.value(held.as_borrowed(), depth + 1)
            }
        }
    }

    fn dict(&mut self, d: Borrowed<'_, '_, PyAny>, depth: usize) -> PyResult<()> {
        let py = d.py();
        self.out.push(b'{');
        let mut pos: ffi::Py_ssize_t = 0;
        let (mut k, mut v) = (std::ptr::null_mut(), std::ptr::null_mut());
        // SAFETY: `d` is exactly a dict.
        let len = unsafe { ffi::PyDict_Size(d.as_ptr()) };
        let mut n = 0;
        // SAFETY: `d` is a dict, the out-pointers are ours; the key and value are borrowed
        // references owned by the dict, used before any Python code runs (`item` holds
        // the value by a reference of its own where writing it may run some).
        while unsafe { ffi::PyDict_Next(d.as_ptr(), &mut pos, &mut k, &mut v) } != 0 {
            // SAFETY: as above.
            let (key, val) = unsafe { (Borrowed::from_ptr(py, k), Borrowed::from_ptr(py, v)) };
            if n > 0 {
                self.out.extend_from_slice(b", ");
            }
            n += 1;
            if exact(key) == Exact::Str {
                self.str(key)?;
            } else {
                let key = key.cast::<PyString>().map_err(|_| {
                    refused(
                        py,
                        format!("tensorwire.rpc: dict keys must be str (JSON objects), not {}", type_name(&key)),
                    )
                })?;
                json::write_str(&mut self.out, key.to_str()?);
            }
            self.out.extend_from_slice(b": ");
            self.item(val, depth)?;
            // As iterating a dict in Python: a change of its size while a value was
            // written (by a tensor's export) is an error, not a text of mixed states.
            // SAFETY: `d` is a dict.
            if unsafe { ffi::PyDict_Size(d.as_ptr()) } != len {
                return Err(pyo3::exceptions::PyRuntimeError::new_err("dictionary changed size during iteration"));
            }
        }
        self.out.push(b'}');
        Ok(())
    }

    /// A str (or subclass) as a JSON string.
    fn str(&mut self, s: Borrowed<'_, '_, PyAny>) -> PyResult<()> {
        // SAFETY: the caller checked that `s` is a str.
        let s = unsafe { s.cast_unchecked::<PyString>() };
        json::write_str(&mut self.out, s.to_str()?);
        Ok(())
    }

    /// An int (or subclass, not bool) as its decimal digits.
    fn int(&mut self, i: Borrowed<'_, '_, PyAny>) -> PyResult<()> {
        let py = i.py();
        let mut overflow = 0;
        // SAFETY: the caller checked that `i` is an int; overflow is reported in
        // `overflow`, any other failure as -1 with an exception set.
        let v = unsafe { ffi::PyLong_AsLongLongAndOverflow(i.as_ptr(), &mut overflow) };
        if overflow == 0 {
            if v == -1 {
                if let Some(e) = PyErr::take(py) {
                    return Err(e);
                }
            }
            json::write_int(&mut self.out, v);
            return Ok(());
        }
        let s = i.str()?;
        let s = s.to_str()?;
        let digits = s.strip_prefix('-').unwrap_or(s);
        if digits.is_empty() || !digits.bytes().all(|c| c.is_ascii_digit()) {
            return Err(refused(py, format!("tensorwire.rpc: the int {s:?} does not print as decimal digits")));
        }
        self.out.extend_from_slice(s.as_bytes());
        Ok(())
    }

    /// Anything but an exact str, int, float, dict, list or tuple: None, a bool, a
    /// subclass of those types, a tensor — or a refusal naming its type.
    fn other(&mut self, obj: &Bound<'_, PyAny>, depth: usize) -> PyResult<()> {
        let py = obj.py();
        if obj.is_none() {
            self.out.extend_from_slice(b"null");
        } else if let Ok(b) = obj.cast::<PyBool>() {
            // Before int: Python's bool is an int.
            self.out.extend_from_slice(if b.is_true() { b"true" } else { b"false" });
        } else if obj.cast::<PyInt>().is_ok() {
            self.int(obj.as_borrowed())?;
        } else if let Ok(f) = obj.cast::<PyFloat>() {
            json::write_float(&mut self.out, f.value());
        } else if obj.cast::<PyString>().is_ok() {
            self.str(obj.as_borrowed())?;
        } else if let Ok(l) = obj.cast::<PyList>() {
            self.out.push(b'[');
            for (n, x) in l.iter().enumerate() {
                if n > 0 {
                    self.out.extend_from_slice(b", ");
                }
                self.value(x.as_borrowed(), depth + 1)?;
            }
            self.out.push(b']');
        } else if let Ok(t) = obj.cast::<PyTuple>() {
            self.out.push(b'[');
            for (n, x) in t.iter().enumerate() {
                if n > 0 {
                    self.out.extend_from_slice(b", ");
                }
                self.value(x.as_borrowed(), depth + 1)?;
            }
            self.out.push(b']');
        } else if let Ok(d) = obj.cast::<PyDict>() {
            self.out.push(b'{');
            for (n, (k, v)) in d.iter().enumerate() {
                let key = k.cast::<PyString>().map_err(|_| {
                    refused(
                        py,
                        format!("tensorwire.rpc: dict keys must be str (JSON objects), not {}", type_name(&k)),
                    )
                })?;
                if n > 0 {
                    self.out.extend_from_slice(b", ");
                }
                json::write_str(&mut self.out, key.to_str()?);
                self.out.extend_from_slice(b": ");
                self.value(v.as_borrowed(), depth + 1)?;
            }
            self.out.push(b'}');
        } else {
            match tensor_value(obj)? {
                Some(Value::Tensor(t)) => self.tensors.push((self.out.len(), *t)),
                Some(_) => return Err(refused(py, "tensorwire.rpc: a tensor did not become a tensor value".into())),
                None => {
                    return Err(refused(
                        py,
                        format!(
                            "tensorwire.rpc cannot send a {}: values are JSON data (None, bool, int, float, str, list, tuple, dict with str keys) and torch tensors, never pickled",
                            type_name(obj)
                        ),
                    ));
                }
            }
        }
        Ok(())
    }
}

/// The Python object of one received value's text.
pub fn read(py: Python<'_>, text: &str) -> PyResult<Py<PyAny>> {
    let keys = KEYS.with(|k| k.take());
    let mut r = Reader { py, text, b: text.as_bytes(), i: 0, keys, items: Vec::new() };
    let v = (|| {
        r.ws();
        let v = r.value(0)?;
        r.ws();
        if r.i != r.b.len() {
            return Err(r.err("extra data after the value"));
        }
        Ok(v.unbind())
    })();
    KEYS.with(|k| k.replace(r.keys));
    v
}

/// Dict keys made on this thread, by text: a key met again — in the next record of a
/// list, or in the next call's value of the same shape — is the same `str`, made and
/// hashed once (`json.loads` shares keys within one value the same way). Direct-mapped
/// and bounded: a key only replaces the one in its slot, so keys a peer chooses cost
/// at most a miss each.
#[derive(Default)]
struct KeyCache {
    slots: Vec<Option<(Box<str>, Py<PyString>)>>,
}

impl KeyCache {
    const SLOTS: usize = 1024;
    /// Keys this long or longer are made each time (rarely repeated, costly to compare).
    const MAX_KEY_BYTES: usize = 64;

    fn key<'py>(&mut self, py: Python<'py>, k: &str) -> Bound<'py, PyString> {
        if k.len() >= Self::MAX_KEY_BYTES {
            return PyString::new(py, k);
        }
        if self.slots.is_empty() {
            self.slots.resize_with(Self::SLOTS, || None);
        }
        // The length and the first and last (up to) eight bytes, mixed: a few
        // instructions for any key, and a collision only costs a miss.
        let b = k.as_bytes();
        let word = |at: &[u8]| at.iter().fold(0u64, |w, &c| (w << 8) | u64::from(c));
        let mixed = if b.len() <= 8 { word(b) } else { word(&b[..8]) ^ word(&b[b.len() - 8..]).rotate_left(29) };
        let h = (mixed ^ b.len() as u64).wrapping_mul(0x9E37_79B9_7F4A_7C15) >> 32;
        let slot = &mut self.slots[(h as usize) % Self::SLOTS];
        if let Some((text, s)) = slot {
            if **text == *k {
                return s.bind(py).clone();
            }
        }
        let s = PyString::new(py, k);
        *slot = Some((k.into(), s.clone().unbind()));
        s
    }
}

thread_local! {
    static KEYS: RefCell<KeyCache> = RefCell::new(KeyCache::default());
}

struct Reader<'a, 'py> {
    py: Python<'py>,
    text: &'a str,
    b: &'a [u8],
    i: usize,
    keys: KeyCache,
    /// The items of the lists being read, innermost last: each list is made once, at
    /// its final length.
    items: Vec<Bound<'py, PyAny>>,
}

impl<'a, 'py> Reader<'a, 'py> {
    fn err(&self, what: &str) -> PyErr {
        refused(self.py, format!("tensorwire.rpc: invalid JSON text at byte {}: {what}", self.i))
    }
    fn ws(&mut self) {
        lex::ws(self.b, &mut self.i);
    }
    fn eat(&mut self, lit: &[u8]) -> bool {
        lex::eat(self.b, &mut self.i, lit)
    }
    fn value(&mut self, depth: usize) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        if depth > READ_DEPTH {
            return Err(self.err(&format!("nested deeper than {READ_DEPTH} levels")));
        }
        let Some(&c) = self.b.get(self.i) else { return Err(self.err("unexpected end")) };
        Ok(match c {
            b'{' => {
                self.i += 1;
                let d = PyDict::new(py);
                self.ws();
                if !self.eat(b"}") {
                    loop {
                        self.ws();
                        if self.b.get(self.i) != Some(&b'"') {
                            return Err(self.err("expected a string key"));
                        }
                        let k = self.string()?;
                        let key = self.keys.key(py, &k);
                        self.ws();
                        if !self.eat(b":") {
                            return Err(self.err("expected ':'"));
                        }
                        self.ws();
                        let v = self.item(depth + 1)?;
                        // A repeated key: the last value, in the first one's place, as
                        // `json.loads` has it.
                        d.set_item(key, v)?;
                        self.ws();
                        if self.eat(b",") {
                            continue;
                        }
                        if self.eat(b"}") {
                            break;
                        }
                        return Err(self.err("expected ',' or '}'"));
                    }
                }
                d.into_any()
            }
            b'[' => {
                self.i += 1;
                let first = self.items.len();
                self.ws();
                if !self.eat(b"]") {
                    loop {
                        self.ws();
                        let v = self.item(depth + 1)?;
                        self.items.push(v);
                        self.ws();
                        if self.eat(b",") {
                            continue;
                        }
                        if self.eat(b"]") {
                            break;
                        }
                        return Err(self.err("expected ',' or ']'"));
                    }
                }
                PyList::new(py, self.items.drain(first..))?.into_any()
            }
            _ => self.scalar()?,
        })
    }
    /// [`Reader::value`] of an item: a scalar read here, without a call per leaf.
    #[inline(always)]
    fn item(&mut self, depth: usize) -> PyResult<Bound<'py, PyAny>> {
        match self.b.get(self.i) {
            Some(b'{' | b'[') => self.value(depth),
            _ if depth > READ_DEPTH => self.value(depth),
            _ => self.scalar(),
        }
    }
    /// Anything but a list or dict.
    #[inline(always)]
    fn scalar(&mut self) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        let Some(&c) = self.b.get(self.i) else { return Err(self.err("unexpected end")) };
        Ok(match c {
            b'"' => {
                let s = self.string()?;
                PyString::new(py, &s).into_any()
            }
            b'n' if self.eat(b"null") => py.None().into_bound(py),
            b't' if self.eat(b"true") => PyBool::new(py, true).to_owned().into_any(),
            b'f' if self.eat(b"false") => PyBool::new(py, false).to_owned().into_any(),
            b'N' if self.eat(b"NaN") => PyFloat::new(py, f64::NAN).into_any(),
            b'I' if self.eat(b"Infinity") => PyFloat::new(py, f64::INFINITY).into_any(),
            b'-' if self.eat(b"-Infinity") => PyFloat::new(py, f64::NEG_INFINITY).into_any(),
            b'-' | b'0'..=b'9' => self.number()?,
            _ => return Err(self.err("expected a value")),
        })
    }
    fn string(&mut self) -> PyResult<Cow<'a, str>> {
        lex::string(self.text, &mut self.i).map_err(|what| self.err(what))
    }
    /// A number as the tree parser reads it: an int when it has no fraction or exponent
    /// (of any length up to Python's digit limit), else a float.
    fn number(&mut self) -> PyResult<Bound<'py, PyAny>> {
        let py = self.py;
        Ok(match lex::number(self.text, &mut self.i).map_err(|what| self.err(what))? {
            Number::Int(i) => i.into_pyobject(py)?.into_any(),
            Number::BigInt(digits) => py.get_type::<PyInt>().call1((digits,))?,
            Number::Float(f) => PyFloat::new(py, f).into_any(),
        })
    }
}

/// Deepest nesting the reader follows. The text was checked within the connection's
/// `max_depth` already; this bounds the reader's own recursion whatever that is set to.
const READ_DEPTH: usize = 1024;
