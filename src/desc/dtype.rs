//! Element types, device kinds and storage kinds, with their wire codes.

/// Defines [`DType`] from one table, a row per dtype: its variant, its `c10::ScalarType`
/// number, its bytes per element and PyTorch's name for it. The enum, [`DType::ALL`],
/// [`DType::size`] and [`DType::name`] all come from these rows, so they cannot disagree.
/// (The C ABI's `tw_dtype_e` is spelled out for cbindgen; `ffi/tests/c_header.rs` checks it
/// against `DType::ALL`.)
macro_rules! dtypes {
    ($($variant:ident = $code:literal, $size:literal bytes, $name:literal;)*) => {
        /// Element types, numbered exactly like `c10::ScalarType`.
        #[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
        #[repr(u8)]
        pub enum DType {
            $($variant = $code,)*
        }

        impl DType {
            /// Every supported dtype.
            pub const ALL: [DType; [$($code),*].len()] = [$(DType::$variant),*];

            /// Bytes per element.
            pub fn size(self) -> usize {
                match self {
                    $(DType::$variant => $size,)*
                }
            }

            /// PyTorch's name (`torch.<name>`).
            pub fn name(self) -> &'static str {
                match self {
                    $(DType::$variant => $name,)*
                }
            }
        }
    };
}

dtypes! {
    UInt8 = 0, 1 bytes, "uint8";
    Int8 = 1, 1 bytes, "int8";
    Int16 = 2, 2 bytes, "int16";
    Int32 = 3, 4 bytes, "int32";
    Int64 = 4, 8 bytes, "int64";
    Float16 = 5, 2 bytes, "float16";
    Float32 = 6, 4 bytes, "float32";
    Float64 = 7, 8 bytes, "float64";
    Complex32 = 8, 4 bytes, "complex32";
    Complex64 = 9, 8 bytes, "complex64";
    Complex128 = 10, 16 bytes, "complex128";
    Bool = 11, 1 bytes, "bool";
    BFloat16 = 15, 2 bytes, "bfloat16";
    Float8E5M2 = 23, 1 bytes, "float8_e5m2";
    Float8E4M3Fn = 24, 1 bytes, "float8_e4m3fn";
    Float8E5M2Fnuz = 25, 1 bytes, "float8_e5m2fnuz";
    Float8E4M3Fnuz = 26, 1 bytes, "float8_e4m3fnuz";
    UInt16 = 27, 2 bytes, "uint16";
    UInt32 = 28, 4 bytes, "uint32";
    UInt64 = 29, 8 bytes, "uint64";
    Float8E8M0Fnu = 44, 1 bytes, "float8_e8m0fnu";
}

impl DType {
    /// The dtype with this `c10::ScalarType` number, if tensorwire supports it.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as u8 == code)
    }
}

/// Device kinds, numbered like `c10::DeviceType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum DeviceType {
    Cpu = 0,
    Cuda = 1,
}

/// What kind of storage a descriptor refers to.
#[derive(Debug, Clone, Copy, PartialEq, Eq)]
#[repr(u8)]
pub enum StorageKind {
    /// A region of a shared CPU segment, kept alive by a lease.
    Segment = 1,
    /// A slot of a bounce-buffer ring.
    RingSlot = 2,
    /// A CUDA IPC memory handle plus offset from the allocation base.
    CudaIpc = 3,
    /// A CUDA VMM allocation shared by fd.
    CudaVmm = 4,
}

impl StorageKind {
    pub(super) fn from_code(c: u8) -> Option<StorageKind> {
        Some(match c {
            1 => StorageKind::Segment,
            2 => StorageKind::RingSlot,
            3 => StorageKind::CudaIpc,
            4 => StorageKind::CudaVmm,
            _ => return None,
        })
    }
}
