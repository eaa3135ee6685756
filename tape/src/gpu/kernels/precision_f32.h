#define real float
#define SFX(name) name##_f32
#define EXP expf
#define LOG logf
#define TANH tanhf
#define ERF erff
#define SQRT sqrtf
#define MUL_RN MUL_RN_F32
