export class LinearResampler {
    /**
     * @param {number} fromRate
     * @param {number} toRate
     */
    constructor(fromRate: number, toRate: number);
    step: number;
    pos: number;
    prev: number;
    passthrough: boolean;
    /**
     * @param {Float32Array} input
     * @returns {Float32Array}
     */
    process(input: Float32Array): Float32Array;
}
