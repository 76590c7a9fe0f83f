//! acceld driven over a real vhost-user socket by the `vhost` crate's Frontend, no QEMU:
//! handshake, every request type, descriptor layouts, hostile chains, multiqueue, reconnect.

use std::time::Duration;

use accel_dataplane::drive::DiscardMode;
use accel_tests::harness::{ServerOptions, TestServer};
use accel_tests::{
    dwz_segment, header, pattern, BlkFrontend, Buf, FrontendOptions, S_IOERR, S_OK, S_UNSUPP,
    T_DISCARD, T_FLUSH, T_GET_ID, T_IN, T_OUT, T_WRITE_ZEROES, VHOST_F_LOG_ALL,
    VIRTIO_RING_F_EVENT_IDX,
};

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
    let fe = s.frontend(2);
    let n = &fe.negotiated;
    assert_eq!(n.queue_num, 2);
    assert_eq!(n.capacity_sectors(), (64 << 20) / 512);
    assert_ne!(n.features & VIRTIO_RING_F_EVENT_IDX, 0);
    // Dirty logging (live migration) is offered, with its protocol feature.
    assert_ne!(n.features & VHOST_F_LOG_ALL, 0);
    assert_ne!(n.protocol_features & (1 << 1), 0, "LOG_SHMFD");
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
    let mut fe = s.frontend(1);
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
    let mut fe = s.frontend(1);
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
    let mut fe = s.frontend(1);
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
    let mut fe = s.frontend(1);
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
    let mut fe = s.frontend(1);
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
    let mut fe = s.frontend(1);
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
    let mut fe = s.frontend(2);
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
        let mut fe = s.frontend(2);
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
    let done = s.drive.stats.acct.counters().writes();
    assert_eq!(done, u64::from(base));
}

/// The write cache (config `writeback`): on for a driver that negotiated FLUSH; the driver can
/// turn it off (CONFIG_WCE) and then every write is write-through; data goes on either way.
#[test]
fn write_cache_follows_the_driver() {
    use vhost::vhost_user::message::VhostUserConfigFlags;
    use vhost::vhost_user::VhostUserFrontend as _;
    let s = TestServer::start(&ServerOptions::default());
    let mut fe = s.frontend(1);
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

/// Every ring start interrupts the driver once: a previous server may have
/// put completions in the used ring and died before its interrupt (SIGKILL between the two),
/// and a driver reads the used ring only when interrupted (a guest hung that way).
#[test]
fn every_ring_start_interrupts_the_driver_once() {
    use std::os::fd::AsRawFd;
    let readable = |fe: &BlkFrontend| {
        let mut pfd = libc::pollfd {
            fd: fe.call_fd(0).as_raw_fd(),
            events: libc::POLLIN,
            revents: 0,
        };
        // SAFETY: one valid pollfd for the duration of the call.
        unsafe { libc::poll(&mut pfd, 1, 10_000) };
        let got = pfd.revents & libc::POLLIN != 0;
        let _ = fe.call_fd(0).read();
        got
    };
    let s = TestServer::start(&ServerOptions::default());
    let mut fe = s.frontend(1);
    assert!(readable(&fe), "no interrupt at the first start");
    let data = patterned(0, 3, 4096);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().1, data);
}

/// A resize reaches the frontend as QEMU's vhost-user-blk expects it: acceld keeps the backend
/// channel the frontend gives (SET_BACKEND_REQ_FD) and sends
/// VHOST_USER_BACKEND_CONFIG_CHANGE_MSG on it; GET_CONFIG then shows the new capacity, and
/// requests past the old end are served.
#[test]
fn a_resize_reaches_the_frontend_on_the_backend_channel() {
    use std::io::Read;
    use vhost::vhost_user::message::VhostUserConfigFlags;
    use vhost::vhost_user::VhostUserFrontend as _;
    let s = TestServer::start(&ServerOptions::default());
    let mut fe = s.frontend(1);
    let (mut mine, theirs) = std::os::unix::net::UnixStream::pair().unwrap();
    fe.frontend().set_backend_request_fd(&theirs).unwrap();
    drop(theirs);
    // No reply to wait for (REPLY_ACK is not asked for it): a round trip orders the two.
    let config = |fe: &mut BlkFrontend| {
        let (_, cfg) = fe
            .frontend()
            .get_config(0, 60, VhostUserConfigFlags::empty(), &[0u8; 60])
            .unwrap();
        u64::from_le_bytes(cfg[0..8].try_into().unwrap())
    };
    let old = s.drive.capacity();
    assert_eq!(config(&mut fe), old / 512);
    std::fs::OpenOptions::new()
        .write(true)
        .open(&s.image)
        .unwrap()
        .set_len(old * 2)
        .unwrap();
    assert_eq!(s.drive.set_capacity(old * 2), old * 2);
    assert!(accel_dataplane::vhost::notify_config_change(&s.drive).unwrap());
    mine.set_read_timeout(Some(Duration::from_secs(10)))
        .unwrap();
    let mut hdr = [0u8; 12];
    mine.read_exact(&mut hdr).unwrap();
    let word = |i: usize| u32::from_le_bytes(hdr[i..i + 4].try_into().unwrap());
    assert_eq!(
        (word(0), word(4), word(8)),
        (2, 1, 0),
        "CONFIG_CHANGE_MSG, version 1, no reply wanted, no payload"
    );
    assert_eq!(config(&mut fe), old * 2 / 512);
    let data = patterned(0, 9, 4096);
    assert_eq!(fe.request(0, T_OUT, old / 512, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, old / 512, &[], 4096).unwrap().1, data);
    // Past the new end: IOERR, as before the resize past the old one.
    assert_eq!(
        fe.request(0, T_IN, old * 2 / 512, &[], 4096).unwrap().0,
        S_IOERR
    );
}

/// Writes one descriptor (16 bytes) of a table the test builds itself.
fn put_desc(fe: &BlkFrontend, gpa: u64, addr: u64, len: u32, flags: u16, next: u16) {
    let mut d = [0u8; 16];
    d[0..8].copy_from_slice(&addr.to_le_bytes());
    d[8..12].copy_from_slice(&len.to_le_bytes());
    d[12..14].copy_from_slice(&flags.to_le_bytes());
    d[14..16].copy_from_slice(&next.to_le_bytes());
    fe.mem.write(gpa, &d);
}

const F_NEXT: u16 = 1;
const F_WRITE: u16 = 2;
const F_INDIRECT: u16 = 4;

#[test]
fn indirect_tables_are_checked_like_chains() {
    ServerOptions::each_mode(indirect_tables_are_checked_like_chains_on);
}

/// Indirect tables get the checks of a direct chain (VIRTIO 1.2 §2.7.5.3): a table whose
/// entries loop, a nested table, a `next` past the table, an empty or oversized table, a
/// table outside memory. Each request is answered (IOERR where it has a status byte), never
/// served as OK, and the queue goes on.
fn indirect_tables_are_checked_like_chains_on(base: &ServerOptions) {
    let s = TestServer::start(base);
    let mut fe = s.frontend(1);
    let sl = fe.slot(0, 5);
    let t = sl.indirect;
    let answer = |fe: &mut BlkFrontend, descs: &[(u64, u32, u16, u16)]| {
        fe.mem.write(sl.status, &[0xff]);
        let head = fe.submit_raw(0, descs).unwrap();
        let mut used = Vec::new();
        fe.wait_used(0, &mut used, Duration::from_secs(5)).unwrap();
        assert_eq!(used[0].head, head);
        let mut st = [0u8];
        fe.mem.read(sl.status, &mut st);
        st[0]
    };
    fe.mem.write(sl.header, &header(T_IN, 0));
    // header -> status -> header ...: the entries loop.
    put_desc(&fe, t, sl.header, 16, F_NEXT, 1);
    put_desc(&fe, t + 16, sl.status, 1, F_WRITE | F_NEXT, 0);
    assert_eq!(
        answer(&mut fe, &[(t, 32, F_INDIRECT, 0)]),
        S_IOERR,
        "looped table"
    );
    // A `next` past the end of the table.
    put_desc(&fe, t, sl.header, 16, F_NEXT, 7);
    put_desc(&fe, t + 16, sl.status, 1, F_WRITE, 0);
    assert_ne!(
        answer(&mut fe, &[(t, 32, F_INDIRECT, 0)]),
        S_OK,
        "next past the table"
    );
    // A table inside a table.
    put_desc(&fe, t, sl.header, 16, F_NEXT, 1);
    put_desc(&fe, t + 16, t + 64, 32, F_INDIRECT, 0);
    put_desc(&fe, t + 64, sl.status, 1, F_WRITE, 0);
    assert_ne!(
        answer(&mut fe, &[(t, 32, F_INDIRECT, 0)]),
        S_OK,
        "nested table"
    );
    // Empty, oversized (more than 65535 entries), outside guest memory, not a multiple of 16.
    for (addr, len) in [(t, 0u32), (t, 16 << 16), (1u64 << 41, 32), (t, 20)] {
        assert_ne!(
            answer(&mut fe, &[(addr, len, F_INDIRECT, 0)]),
            S_OK,
            "{addr:#x}+{len}"
        );
    }
    // A well-formed indirect request still works, and so does the queue.
    put_desc(&fe, t, sl.header, 16, F_NEXT, 1);
    put_desc(&fe, t + 16, sl.status, 1, F_WRITE, 0);
    fe.mem.write(sl.header, &header(T_FLUSH, 0));
    assert_eq!(answer(&mut fe, &[(t, 32, F_INDIRECT, 0)]), S_OK);
    let data = patterned(0, 3, 512);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 512).unwrap().1, data);
}

#[test]
fn a_corrupt_ring_breaks_only_its_queue() {
    for (mode, base) in ServerOptions::modes() {
        println!("mode {mode}");
        a_corrupt_ring_breaks_only_its_queue_on(&ServerOptions {
            name: "brk".into(),
            ..base
        });
    }
}

/// Ring-level corruption, as QEMU's `virtqueue_pop` sees it: an avail index more than the
/// queue size ahead, a head at or past the queue size. The queue stops (no spinning: its
/// worker uses no CPU while the other queue serves thousands of requests), the vring's error
/// eventfd fires, status counts it; the other queue keeps serving; a reconnect clears it.
fn a_corrupt_ring_breaks_only_its_queue_on(base: &ServerOptions) {
    let s = TestServer::start(&ServerOptions {
        queues: 2,
        ..base.clone()
    });
    let broken = || {
        s.drive
            .stats
            .broken_queues
            .load(std::sync::atomic::Ordering::Relaxed)
    };
    for case in ["avail index jump", "head past the table"] {
        let mut fe = s.frontend(2);
        let data = patterned(0, 4, 4096);
        assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
        match case {
            "avail index jump" => fe.corrupt_avail_idx(0, fe.queue_size() + 5),
            _ => fe.publish_head(0, fe.queue_size() + 3),
        }
        assert!(
            fe.wait_err(0, Duration::from_secs(10)),
            "{case}: error eventfd"
        );
        assert_eq!(broken(), 1, "{case}");
        let cpu0 = accel_tests::thread_cpu("brk-q0").expect("the queue's worker thread");
        for i in 0..2000u64 {
            let st = fe.request(1, T_OUT, 8 * (i % 64), &data, 0).unwrap().0;
            assert_eq!(st, S_OK, "{case}: queue 1 serves");
        }
        assert_eq!(fe.request(1, T_IN, 0, &[], 4096).unwrap().1, data);
        let spent = accel_tests::thread_cpu("brk-q0").expect("still there") - cpu0;
        println!("{case}: the broken queue's worker used {spent:?} of CPU meanwhile");
        assert!(
            spent < Duration::from_millis(150),
            "{case}: the broken queue spins ({spent:?} of CPU)"
        );
        // GET_VRING_BASE on the broken queue still answers (nothing in flight).
        fe.get_vring_base(0).unwrap();
        drop(fe);
        // A new connection (a frontend reset) clears it.
        let mut fe = s.frontend(2);
        assert_eq!(broken(), 0, "{case}: cleared by the reconnect");
        assert_eq!(fe.request(0, T_IN, 0, &[], 4096).unwrap().1, data);
    }
    assert_eq!(
        s.drive
            .stats
            .ring_errors
            .load(std::sync::atomic::Ordering::Relaxed),
        2
    );
}

/// A memory table whose region reaches past the end of its file: mapping it is possible, but
/// touching the pages past the end would be SIGBUS and end acceld with every drive it serves.
/// acceld refuses the table and goes on serving.
#[test]
fn a_memory_region_past_its_file_is_refused() {
    use vhost::{VhostBackend, VhostUserMemoryRegionInfo};
    let s = TestServer::start(&ServerOptions::default());
    let mem = accel_tests::GuestMem::new(1 << 20).unwrap();
    let (fe, _) = accel_tests::handshake(&s.socket, 1).unwrap();
    // REPLY_ACK (negotiated by the handshake): every message gets its answer.
    fe.set_hdr_flags(vhost::vhost_user::message::VhostUserHeaderFlag::NEED_REPLY);
    for (size, offset) in [(2u64 << 20, 0u64), (1 << 20, 4096), (u64::MAX, 0), (0, 0)] {
        let region = VhostUserMemoryRegionInfo {
            guest_phys_addr: 0,
            memory_size: size,
            userspace_addr: mem.host_addr(),
            mmap_offset: offset,
            mmap_handle: std::os::fd::AsRawFd::as_raw_fd(&mem.file),
        };
        assert!(
            fe.set_mem_table(&[region]).is_err(),
            "a region of {size} bytes at offset {offset} over a 1 MiB file was accepted"
        );
    }
    drop(fe);
    let mut fe = s.frontend(1);
    let data = patterned(0, 9, 512);
    assert_eq!(fe.request(0, T_OUT, 0, &data, 0).unwrap().0, S_OK);
    assert_eq!(fe.request(0, T_IN, 0, &[], 512).unwrap().1, data);
}

/// Rings that overlap (here the used ring over the avail ring, so that the device's own
/// notification writes change the avail index it reads: a device that re-checks would spin
/// forever) are refused when the queue starts.
#[test]
fn overlapping_rings_are_refused() {
    use vhost::vhost_user::message::VhostUserHeaderFlag;
    use vhost::vhost_user::VhostUserFrontend;
    use vhost::{VhostBackend, VhostUserMemoryRegionInfo, VringConfigData};
    use vmm_sys_util::eventfd::EventFd;
    let s = TestServer::start(&ServerOptions::default());
    let mem = accel_tests::GuestMem::new(1 << 20).unwrap();
    let (mut fe, _) = accel_tests::handshake(&s.socket, 1).unwrap();
    fe.set_features(fe.get_features().unwrap() & !(1 << 29))
        .unwrap();
    let host = mem.host_addr();
    // The answers to these come with the last message's (no REPLY_ACK until then).
    let _ = fe.set_mem_table(&[VhostUserMemoryRegionInfo {
        guest_phys_addr: 0,
        memory_size: 1 << 20,
        userspace_addr: host,
        mmap_offset: 0,
        mmap_handle: std::os::fd::AsRawFd::as_raw_fd(&mem.file),
    }]);
    let _ = fe.set_vring_num(0, 64);
    let _ = fe.set_vring_base(0, 0);
    let _ = fe.set_vring_addr(
        0,
        &VringConfigData {
            queue_max_size: 64,
            queue_size: 64,
            flags: 0,
            desc_table_addr: host + 0x1000,
            avail_ring_addr: host + 0x2000,
            // used->flags lands on avail->idx.
            used_ring_addr: host + 0x2002,
            log_addr: None,
        },
    );
    let (kick, call) = (EventFd::new(0).unwrap(), EventFd::new(0).unwrap());
    let _ = fe.set_vring_call(0, &call);
    let _ = fe.set_vring_kick(0, &kick);
    // The queue starts (or refuses to) on this message: ask for its answer.
    fe.set_hdr_flags(VhostUserHeaderFlag::NEED_REPLY);
    assert!(
        fe.set_vring_enable(0, true).is_err(),
        "a queue with overlapping rings started"
    );
    drop(fe);
    // The server goes on.
    let mut fe = s.frontend(1);
    assert_eq!(fe.request(0, T_FLUSH, 0, &[], 0).unwrap().0, S_OK);
}
