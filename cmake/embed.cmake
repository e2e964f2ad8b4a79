# embed.cmake — cmake -DINPUT=file -DOUTPUT=file.c -DSYMBOL=name -P embed.cmake
# Turns a text file into `const char SYMBOL[]` (NUL-terminated) so tools carry a default config.
file(READ "${INPUT}" hex HEX)
string(REGEX REPLACE "([0-9a-f][0-9a-f])" "0x\\1," bytes "${hex}")
string(REGEX REPLACE "(0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,0x..,)" "\\1\n  " bytes "${bytes}")
get_filename_component(name "${INPUT}" NAME)
file(WRITE "${OUTPUT}" "/* Generated from ${name} by cmake/embed.cmake; do not edit. */\nconst char ${SYMBOL}[] = {\n  ${bytes}0x00};\n")
