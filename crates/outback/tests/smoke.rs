mod common;

use dmkv_transport::exec::block_on;

#[test]
fn insert_get_update_delete() {
    let d = common::deploy();
    let (_ep, s) = d.client(0).unwrap();
    block_on(async {
        for k in 1..200u64 {
            assert!(s.insert(k, &k.to_le_bytes()).await.unwrap(), "insert {k}");
        }
        for k in 1..200u64 {
            assert_eq!(
                s.get(k).await.unwrap(),
                Some(k.to_le_bytes().to_vec()),
                "get {k}"
            );
        }
        assert!(!s.insert(5, b"x").await.unwrap());
        assert!(s.update(5, b"xyz").await.unwrap());
        assert_eq!(s.get(5).await.unwrap(), Some(b"xyz".to_vec()));
        assert!(s.delete(5).await.unwrap());
        assert_eq!(s.get(5).await.unwrap(), None);
        assert!(!s.delete(5).await.unwrap());
        assert_eq!(s.get(1000).await.unwrap(), None);
    });
    let ep = d.endpoint(0);
    let st = block_on(d.engine.stats(&ep)).unwrap();
    println!("{st:#}");
}
