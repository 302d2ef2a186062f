//! Element types, device kinds and storage kinds, with their wire codes.

/// Element types, numbered exactly like `c10::ScalarType`.
#[derive(Debug, Clone, Copy, PartialEq, Eq, Hash)]
#[repr(u8)]
pub enum DType {
    UInt8 = 0,
    Int8 = 1,
    Int16 = 2,
    Int32 = 3,
    Int64 = 4,
    Float16 = 5,
    Float32 = 6,
    Float64 = 7,
    Complex32 = 8,
    Complex64 = 9,
    Complex128 = 10,
    Bool = 11,
    BFloat16 = 15,
    Float8E5M2 = 23,
    Float8E4M3Fn = 24,
    Float8E5M2Fnuz = 25,
    Float8E4M3Fnuz = 26,
    UInt16 = 27,
    UInt32 = 28,
    UInt64 = 29,
    Float8E8M0Fnu = 44,
}

impl DType {
    /// Every supported dtype.
    pub const ALL: [DType; 21] = [
        DType::UInt8,
        DType::Int8,
        DType::Int16,
        DType::Int32,
        DType::Int64,
        DType::Float16,
        DType::Float32,
        DType::Float64,
        DType::Complex32,
        DType::Complex64,
        DType::Complex128,
        DType::Bool,
        DType::BFloat16,
        DType::Float8E5M2,
        DType::Float8E4M3Fn,
        DType::Float8E5M2Fnuz,
        DType::Float8E4M3Fnuz,
        DType::UInt16,
        DType::UInt32,
        DType::UInt64,
        DType::Float8E8M0Fnu,
    ];

    /// The dtype with this `c10::ScalarType` number, if tensorwire supports it.
    pub fn from_code(code: u8) -> Option<DType> {
        DType::ALL.iter().copied().find(|d| *d as u8 == code)
    }

    /// Bytes per element.
    pub fn size(self) -> usize {
        use DType::*;
        match self {
            UInt8 | Int8 | Bool | Float8E5M2 | Float8E4M3Fn | Float8E5M2Fnuz | Float8E4M3Fnuz | Float8E8M0Fnu => 1,
            Int16 | UInt16 | Float16 | BFloat16 => 2,
            Int32 | UInt32 | Float32 | Complex32 => 4,
            Int64 | UInt64 | Float64 | Complex64 => 8,
            Complex128 => 16,
        }
    }

    /// PyTorch's name (`torch.<name>`).
    pub fn name(self) -> &'static str {
        use DType::*;
        match self {
            UInt8 => "uint8",
            Int8 => "int8",
            Int16 => "int16",
            Int32 => "int32",
            Int64 => "int64",
            Float16 => "float16",
            Float32 => "float32",
            Float64 => "float64",
            Complex32 => "complex32",
            Complex64 => "complex64",
            Complex128 => "complex128",
            Bool => "bool",
            BFloat16 => "bfloat16",
            Float8E5M2 => "float8_e5m2",
            Float8E4M3Fn => "float8_e4m3fn",
            Float8E5M2Fnuz => "float8_e5m2fnuz",
            Float8E4M3Fnuz => "float8_e4m3fnuz",
            UInt16 => "uint16",
            UInt32 => "uint32",
            UInt64 => "uint64",
            Float8E8M0Fnu => "float8_e8m0fnu",
        }
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
