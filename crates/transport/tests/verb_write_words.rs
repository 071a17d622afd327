//! A write verb stores every whole word of its data, for every word count
//! a batch's write can have (i90: `store_words` handles eight words a step
//! and then straight-line steps of four, two and one word, so each count
//! from 0 to 19 takes a different mix of them), and nothing around it.

use dmkv_transport::NodeHost;
use dmkv_transport::exec::block_on;
use dmkv_transport::local::{LocalCluster, LocalConfig};

#[test]
fn a_write_verb_stores_exactly_its_words_for_every_word_count() {
    let cluster = LocalCluster::new(LocalConfig::default());
    let server = cluster.add_node(1);
    let client = cluster.add_node(0).id();
    let (region, mem) = server.register_region(4096).unwrap();
    let ep = cluster.fabric().endpoint(client).unwrap();
    for words in 0..20usize {
        for first_word in [0u64, 1, 3, 8] {
            mem.write(0, &[0xEE; 4096]).unwrap();
            let at = 8 * first_word;
            // Distinct bytes, so a word stored in the wrong place, twice,
            // or from the wrong source bytes shows.
            let data: Vec<u8> = (0..8 * words).map(|i| (i * 7 + words) as u8).collect();
            block_on(async {
                let mut b = ep.batch();
                b.write(region.at(at), data.clone());
                b.run().await.unwrap();
            });
            let mut back = vec![0; 4096];
            mem.read(0, &mut back).unwrap();
            let mut want = vec![0xEE; 4096];
            want[at as usize..at as usize + data.len()].copy_from_slice(&data);
            assert!(
                back == want,
                "{words} words at word {first_word}: stored {:?}",
                &back[..at as usize + data.len() + 8]
            );
        }
    }
}
