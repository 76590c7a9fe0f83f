//! acceld driven over a real vhost-user socket by the `vhost` crate's Frontend, no QEMU:
//! handshake, every request type, descriptor layouts, hostile chains, multiqueue, reconnect.

use std::time::Duration;

use accel_tests::harness::{ServerOptions, TestServer};
use accel_tests::{
    dwz_segment, header, pattern, BlkFrontend, Buf, FrontendOptions, S_IOERR, S_OK, S_UNSUPP,
    T_DISCARD, T_FLUSH, T_GET_ID, T_IN, T_OUT, T_WRITE_ZEROES, VHOST_F_LOG_ALL,
    VIRTIO_RING_F_EVENT_IDX,
};
use acceld::drive::DiscardMode;

fn connect(s: &TestServer, queues: usize) -> BlkFrontend {
    BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queues,
            ..Default::default()
        },
    )
    .expect("connect")
}

fn patterned(off: u64, seed: u64, len: usize) -> Vec<u8> {
    let mut v = vec![0u8; len];
    pattern(off, seed, &mut v);
    v
}

#[test]
fn handshake_reports_features_and_config() {
    let s = TestServer::start(&ServerOptions {
        queues: 2,
        ..Default::default()
    });
    let fe = connect(&s, 2);
    let n = &fe.negotiated;
    assert_eq!(n.queue_num, 2);
    assert_eq!(n.capacity_sectors(), (64 << 20) / 512);
    assert_ne!(n.features & VIRTIO_RING_F_EVENT_IDX, 0);
    // Dirty logging is not implemented, so it is not offered.
    assert_eq!(n.features & VHOST_F_LOG_ALL, 0);
    let seg_max = u32::from_le_bytes(n.config[12..16].try_into().unwrap());
    assert_eq!(seg_max, 126);
    let nq = u16::from_le_bytes(n.config[34..36].try_into().unwrap());
    assert_eq!(nq, 2);
}

#[test]
fn every_request_type() {
    ServerOptions::each_mode(every_request_type_on);
}

fn every_request_type_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = connect(&s, 1);
    let data = patterned(4096, 7, 8192);
    assert_eq!(fe.request(0, T_OUT, 8, &data, 0).unwrap().0, S_OK);
    let (st, back, used) = fe.request(0, T_IN, 8, &[], 8192).unwrap();
    assert_eq!(st, S_OK);
    assert_eq!(used, 8193, "used length = data + status");
    assert_eq!(back, data);
    // The write really reached the image file.
    let on_disk = std::fs::read(&s.image).unwrap();
    assert_eq!(&on_disk[4096..4096 + 8192], &data[..]);

    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);

    let (st, id, used) = fe.request(0, T_GET_ID, 0, &[], 20).unwrap();
    assert_eq!(st, S_OK);
    assert_eq!(used, 21);
    assert_eq!(&id[..17], b"accel-test-serial");
    assert_eq!(&id[17..], &[0, 0, 0]);

    // DISCARD of the first 4 KiB of the written range reads back as zeroes.
    let seg = dwz_segment(8, 8, 0);
    assert_eq!(fe.request(0, T_DISCARD, 0, &seg, 0).unwrap().0, S_OK);
    let (_, back, _) = fe.request(0, T_IN, 8, &[], 4096).unwrap();
    assert!(back.iter().all(|&b| b == 0), "discarded range reads zero");
    // WRITE_ZEROES without and with UNMAP.
    let seg = dwz_segment(16, 4, 0);
    assert_eq!(fe.request(0, T_WRITE_ZEROES, 0, &seg, 0).unwrap().0, S_OK);
    let seg = dwz_segment(20, 4, 1);
    assert_eq!(fe.request(0, T_WRITE_ZEROES, 0, &seg, 0).unwrap().0, S_OK);
    let (_, back, _) = fe.request(0, T_IN, 16, &[], 4096).unwrap();
    assert!(
        back.iter().all(|&b| b == 0),
        "write-zeroes range reads zero"
    );
    // Discard with the UNMAP flag, unknown flags, unknown types: UNSUPP.
    let seg = dwz_segment(0, 8, 1);
    assert_eq!(fe.request(0, T_DISCARD, 0, &seg, 0).unwrap().0, S_UNSUPP);
    assert_eq!(fe.request(0, 14, 0, &[], 0).unwrap().0, S_UNSUPP);
    assert_eq!(fe.request(0, 0x7fff, 0, &[], 0).unwrap().0, S_UNSUPP);
    let st = s
        .drive
        .stats
        .unsupported
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(st, 3);
}

#[test]
fn discard_ignore_keeps_data() {
    ServerOptions::each_mode(discard_ignore_keeps_data_on);
}

fn discard_ignore_keeps_data_on(base: &ServerOptions) {
    let s = TestServer::start(&ServerOptions {
        discard: DiscardMode::Ignore,
        ..base.clone()
    });
    let mut fe = connect(&s, 1);
    let data = patterned(0, 3, 4096);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    let seg = dwz_segment(0, 8, 0);
    assert_eq!(fe.request(0, T_DISCARD, 0, &seg, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().1, data);
}

#[test]
fn read_only_disk_refuses_writes() {
    ServerOptions::each_mode(read_only_disk_refuses_writes_on);
}

fn read_only_disk_refuses_writes_on(base: &ServerOptions) {
    let s = TestServer::start(&ServerOptions {
        read_only: true,
        ..base.clone()
    });
    let mut fe = connect(&s, 1);
    assert_ne!(
        fe.negotiated.features & (1 << 5),
        0,
        "VIRTIO_BLK_F_RO offered"
    );
    assert_eq!(fe.request(0, T_OUT, 0, &[1u8; 512], 0).unwrap().0, S_IOERR);
    let seg = dwz_segment(0, 8, 0);
    assert_eq!(fe.request(0, T_DISCARD, 0, &seg, 0).unwrap().0, S_IOERR);
    assert_eq!(
        fe.request(0, T_WRITE_ZEROES, 0, &seg, 0).unwrap().0,
        S_IOERR
    );
    assert_eq!(fe.request(0, T_IN, 0, &[], 512).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
}

#[test]
fn any_descriptor_layout() {
    ServerOptions::each_mode(any_descriptor_layout_on);
}

fn any_descriptor_layout_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = connect(&s, 1);
    let sl = fe.slot(0, 1);
    let data = patterned(512 * 100, 11, 4096);
    // Header split 5 + 11 bytes; its tail shares a descriptor with the first data bytes; the
    // data is in 3 pieces; the status is the last byte of a writable data descriptor... for a
    // write the status stands alone.
    let mut hdr_and_data = header(T_OUT, 100).to_vec();
    hdr_and_data.extend_from_slice(&data);
    fe.mem.write(sl.data, &hdr_and_data);
    let bufs = [
        Buf::r(sl.data, 5),
        Buf::r(sl.data + 5, 11 + 1000),
        Buf::r(sl.data + 16 + 1000, 2000),
        Buf::r(sl.data + 16 + 3000, 1096),
        Buf::w(sl.status, 1),
    ];
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_OK);
    // Read it back with data and status in one descriptor, through an indirect table.
    fe.mem.write(sl.header, &header(T_IN, 100));
    fe.mem.fill(sl.data, 4097, 0xaa);
    let bufs = [Buf::r(sl.header, 16), Buf::w(sl.data, 4097)];
    let (st, used) = fe.submit_wait(0, &bufs, Some(sl.indirect)).unwrap();
    assert_eq!((st, used), (S_OK, 4097));
    let mut back = vec![0u8; 4096];
    fe.mem.read(sl.data, &mut back);
    assert_eq!(back, data);
    // Many small segments, direct descriptors.
    let mut bufs = vec![Buf::r(sl.header, 16)];
    for i in 0..8 {
        bufs.push(Buf::w(sl.data + 8192 * i, 512));
    }
    bufs.push(Buf::w(sl.status, 1));
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_OK);
    for i in 0..8u64 {
        let mut b = vec![0u8; 512];
        fe.mem.read(sl.data + 8192 * i, &mut b);
        assert_eq!(b, data[512 * i as usize..512 * (i as usize + 1)]);
    }
}

#[test]
fn unaligned_buffers_go_through_the_bounce_pool() {
    ServerOptions::each_mode(unaligned_buffers_go_through_the_bounce_pool_on);
}

fn unaligned_buffers_go_through_the_bounce_pool_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            max_data: 1 << 20,
            ..Default::default()
        },
    )
    .unwrap();
    let sl = fe.slot(0, 2);
    // 600 KiB at an odd address: more than two bounce chunks.
    let len = 600 * 1024;
    let data = patterned(1 << 20, 5, len);
    fe.mem.write(sl.header, &header(T_OUT, (1 << 20) / 512));
    fe.mem.write(sl.data + 3, &data);
    let bufs = [
        Buf::r(sl.header, 16),
        Buf::r(sl.data + 3, len as u32),
        Buf::w(sl.status, 1),
    ];
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_OK);
    fe.mem.write(sl.header, &header(T_IN, (1 << 20) / 512));
    fe.mem.fill(sl.data, len + 8, 0);
    let bufs = [
        Buf::r(sl.header, 16),
        Buf::w(sl.data + 7, len as u32),
        Buf::w(sl.status, 1),
    ];
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_OK);
    let mut back = vec![0u8; len];
    fe.mem.read(sl.data + 7, &mut back);
    assert!(back == data, "bounced read returns the bounced write");
    assert_eq!(
        s.drive
            .stats
            .bounced
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

#[test]
fn hostile_requests_get_a_status_and_the_server_survives() {
    ServerOptions::each_mode(hostile_requests_get_a_status_and_the_server_survives_on);
}

fn hostile_requests_get_a_status_and_the_server_survives_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = connect(&s, 1);
    let cap = fe.negotiated.capacity_sectors();
    let sl = fe.slot(0, 3);
    // Out of range, overflowing, misaligned lengths.
    assert_eq!(fe.request(0, T_IN, cap, &[], 512).unwrap().0, S_IOERR);
    assert_eq!(fe.request(0, T_IN, cap - 1, &[], 1024).unwrap().0, S_IOERR);
    assert_eq!(fe.request(0, T_IN, u64::MAX, &[], 512).unwrap().0, S_IOERR);
    assert_eq!(fe.request(0, T_OUT, 0, &[0u8; 100], 0).unwrap().0, S_IOERR);
    // Data outside guest memory.
    fe.mem.write(sl.header, &header(T_IN, 0));
    let bufs = [
        Buf::r(sl.header, 16),
        Buf::w(1 << 40, 4096),
        Buf::w(sl.status, 1),
    ];
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_IOERR);
    // 4 GiB - 1 lengths, twice.
    let bufs = [
        Buf::r(sl.header, 16),
        Buf::w(sl.data, u32::MAX),
        Buf::w(sl.data, u32::MAX),
        Buf::w(sl.status, 1),
    ];
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_IOERR);
    // A header shorter than 16 bytes.
    let bufs = [Buf::r(sl.header, 8), Buf::w(sl.status, 1)];
    assert_eq!(fe.submit_wait(0, &bufs, None).unwrap().0, S_IOERR);
    // Readable after writable.
    let bufs = [
        Buf::r(sl.header, 16),
        Buf::w(sl.status, 1),
        Buf::r(sl.data, 512),
    ];
    let (_, used) = fe.submit_wait(0, &bufs, None).unwrap();
    assert_eq!(used, 1);
    // No writable byte at all: still answered (used ring), nothing to write the status to.
    let bufs = [Buf::r(sl.header, 16)];
    let (_, used) = fe.submit_wait(0, &bufs, None).unwrap();
    assert_eq!(used, 1);
    // An indirect table whose length is not a multiple of 16, and one outside guest memory:
    // the chain is empty for the device; it is still put in the used ring.
    for (addr, len) in [(sl.indirect, 20u32), (1u64 << 41, 32)] {
        let head = fe.submit_raw(0, &[(addr, len, 4, 0)]).unwrap();
        let mut used = Vec::new();
        fe.wait_used(0, &mut used, Duration::from_secs(5)).unwrap();
        assert_eq!(used[0].head, head);
    }
    // More data segments than acceld takes (1024): IOERR, no allocation of their size.
    let mut bufs = vec![Buf::r(sl.header, 16)];
    for i in 0..1100u64 {
        bufs.push(Buf::w(sl.data + 512 * (i % 64), 512));
    }
    bufs.push(Buf::w(sl.status, 1));
    assert_eq!(
        fe.submit_wait(0, &bufs, Some(sl.data + 65536)).unwrap().0,
        S_IOERR
    );
    assert!(
        s.drive
            .stats
            .io_errors
            .load(std::sync::atomic::Ordering::Relaxed)
            >= 9
    );
    // Still serving.
    let data = patterned(0, 1, 512);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 512).unwrap().1, data);
}

#[test]
fn descriptor_loop_is_cut() {
    ServerOptions::each_mode(descriptor_loop_is_cut_on);
}

fn descriptor_loop_is_cut_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = connect(&s, 1);
    let sl = fe.slot(0, 4);
    fe.mem.write(sl.header, &header(T_IN, 0));
    fe.mem.write(sl.status, &[0xff]);
    // header -> status -> header -> ...: a loop in the descriptor table. The chain is cut at
    // the queue size; it ends on a writable... or readable descriptor, and is answered.
    let head = fe
        .submit_raw(0, &[(sl.header, 16, 1, 1), (sl.status, 1, 1 | 2, 0)])
        .unwrap();
    let mut used = Vec::new();
    fe.wait_used(0, &mut used, Duration::from_secs(5)).unwrap();
    assert_eq!(used[0].head, head);
    // A chain whose `next` points outside the table.
    let head = fe
        .submit_raw(0, &[(sl.header, 16, 1, 4000), (sl.status, 1, 2, 0)])
        .unwrap();
    used.clear();
    fe.wait_used(0, &mut used, Duration::from_secs(5)).unwrap();
    assert_eq!(used[0].head, head);
    let data = patterned(0, 2, 512);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 512).unwrap().1, data);
}

#[test]
fn two_queues_in_parallel() {
    ServerOptions::each_mode(two_queues_in_parallel_on);
}

fn two_queues_in_parallel_on(base: &ServerOptions) {
    let s = TestServer::start(&ServerOptions {
        queues: 2,
        ..base.clone()
    });
    let mut fe = connect(&s, 2);
    for q in 0..2 {
        let data = patterned(q as u64 * 8192, 9, 8192);
        assert_eq!(
            fe.request(q, T_OUT, q as u64 * 16, &data, 0).unwrap().0,
            S_OK
        );
    }
    for q in 0..2 {
        let (_, back, _) = fe.request(1 - q, T_IN, q as u64 * 16, &[], 8192).unwrap();
        assert_eq!(back, patterned(q as u64 * 8192, 9, 8192));
    }
}

#[test]
fn reconnect_ten_times_with_fresh_state() {
    ServerOptions::each_mode(reconnect_ten_times_with_fresh_state_on);
}

fn reconnect_ten_times_with_fresh_state_on(base: &ServerOptions) {
    let s = TestServer::start(&ServerOptions {
        queues: 2,
        ..base.clone()
    });
    for round in 0..10u64 {
        let mut fe = connect(&s, 2);
        let q = (round % 2) as usize;
        let data = patterned(round * 4096, round, 4096);
        assert_eq!(fe.request(q, T_OUT, round * 8, &data, 0).unwrap().0, S_OK);
        for r in 0..=round {
            let (_, back, _) = fe.request(q, T_IN, r * 8, &[], 4096).unwrap();
            assert_eq!(
                back,
                patterned(r * 4096, r, 4096),
                "round {round}, block {r}"
            );
        }
        // GET_VRING_BASE gives exactly the number of requests consumed on that queue.
        assert_eq!(fe.get_vring_base(q).unwrap(), round as u32 + 2);
    }
}

/// GET_VRING_BASE with requests in flight: the reply comes only after every request the server
/// popped is in the used ring, so the base it returns equals the used index (nothing to replay,
/// nothing lost).
#[test]
fn get_vring_base_waits_for_in_flight_requests() {
    ServerOptions::each_mode(get_vring_base_waits_for_in_flight_requests_on);
}

fn get_vring_base_waits_for_in_flight_requests_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = BlkFrontend::connect(
        &s.socket,
        FrontendOptions {
            queue_size: 128,
            max_data: 64 * 1024,
            ..Default::default()
        },
    )
    .unwrap();
    for tag in 0..32u16 {
        let sl = fe.slot(0, tag);
        let data = patterned(u64::from(tag) * 65536, 77, 65536);
        fe.mem
            .write(sl.header, &header(T_OUT, u64::from(tag) * 128));
        fe.mem.write(sl.data, &data);
        fe.mem.write(sl.status, &[0xff]);
        fe.queue_chain(
            0,
            &[
                Buf::r(sl.header, 16),
                Buf::r(sl.data, 65536),
                Buf::w(sl.status, 1),
            ],
        )
        .unwrap();
    }
    fe.kick(0);
    let base = fe.get_vring_base(0).unwrap();
    // Right at the reply, without waiting: every popped request is already used.
    let mut used = Vec::new();
    fe.poll_used(0, &mut used);
    assert_eq!(
        used.len() as u32,
        base,
        "used entries at the GET_VRING_BASE reply"
    );
    println!("GET_VRING_BASE returned {base} with {} used", used.len());
    assert!(base > 0, "the server had started on the requests");
    let done = s
        .drive
        .stats
        .writes
        .load(std::sync::atomic::Ordering::Relaxed);
    assert_eq!(done, u64::from(base));
}

/// The write cache (config `writeback`): on for a driver that negotiated FLUSH; the driver can
/// turn it off (CONFIG_WCE) and then every write is write-through; data goes on either way.
#[test]
fn write_cache_follows_the_driver() {
    use vhost::vhost_user::message::VhostUserConfigFlags;
    use vhost::vhost_user::VhostUserFrontend as _;
    let s = TestServer::start(&ServerOptions::default());
    let mut fe = connect(&s, 1);
    assert_eq!(fe.negotiated.config[32], 1, "writeback shown on");
    assert!(s.drive.writeback());
    fe.frontend()
        .set_config(32, VhostUserConfigFlags::WRITABLE, &[0])
        .unwrap();
    let (_, cfg) = fe
        .frontend()
        .get_config(0, 60, VhostUserConfigFlags::empty(), &[0u8; 60])
        .unwrap();
    assert_eq!(cfg[32], 0, "the driver's choice shows");
    assert!(!s.drive.writeback(), "writes are now write-through");
    let data = patterned(0, 5, 4096);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().1, data);
}
