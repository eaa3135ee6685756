/* 16-bit float storage (bf16, f16) and f32, both ways, rounding to nearest even, with
 * the same bits as the `half` crate on the CPU path (NaNs stay NaN, overflow goes to
 * infinity, f16 keeps subnormals). Needs the prelude's float_bits / bits_float. */

DEVFN u16 f32_to_bf16(float x) {
    unsigned int u = float_bits(x);
    if ((u & 0x7fffffffu) > 0x7f800000u) return (u16)((u >> 16) | 0x40u); /* quiet NaN */
    u += 0x7fffu + ((u >> 16) & 1u);
    return (u16)(u >> 16);
}

DEVFN float bf16_to_f32(u16 h) {
    unsigned int u = (unsigned int)h;
    if ((u & 0x7fffu) > 0x7f80u) u |= 0x40u; /* NaN kept quiet */
    return bits_float(u << 16);
}

DEVFN u16 f32_to_f16(float x) {
    unsigned int u = float_bits(x);
    unsigned int sign = (u >> 16) & 0x8000u;
    unsigned int exponent = u & 0x7f800000u;
    unsigned int mantissa = u & 0x007fffffu;
    if (exponent == 0x7f800000u) { /* infinity, or NaN kept quiet */
        return (u16)(sign | 0x7c00u | (mantissa ? 0x0200u : 0u) | (mantissa >> 13));
    }
    int half_exponent = (int)(exponent >> 23) - 127 + 15;
    if (half_exponent >= 0x1f) return (u16)(sign | 0x7c00u);
    if (half_exponent <= 0) { /* subnormal, or zero */
        if (14 - half_exponent > 24) return (u16)sign;
        unsigned int full = mantissa | 0x00800000u;
        unsigned int shift = (unsigned int)(14 - half_exponent);
        unsigned int result = full >> shift;
        unsigned int round_bit = 1u << (shift - 1);
        if ((full & round_bit) && (full & (3u * round_bit - 1u))) result += 1u;
        return (u16)(sign | result);
    }
    unsigned int result = sign | ((unsigned int)half_exponent << 10) | (mantissa >> 13);
    if ((mantissa & 0x1000u) && (mantissa & 0x2fffu)) result += 1u;
    return (u16)result;
}

DEVFN float f16_to_f32(u16 h) {
    unsigned int sign = ((unsigned int)h & 0x8000u) << 16;
    unsigned int exponent = (unsigned int)h & 0x7c00u;
    unsigned int mantissa = (unsigned int)h & 0x03ffu;
    if (exponent == 0x7c00u) { /* infinity, or NaN kept quiet */
        unsigned int quiet = mantissa ? 0x00400000u : 0u;
        return bits_float(sign | 0x7f800000u | quiet | (mantissa << 13));
    }
    if (exponent == 0) { /* subnormal: exact in f32 as mantissa x 2^-24 */
        float magnitude = (float)mantissa * 5.9604644775390625e-8f;
        return sign ? -magnitude : magnitude;
    }
    return bits_float(sign | (((exponent >> 10) + 112u) << 23) | (mantissa << 13));
}
